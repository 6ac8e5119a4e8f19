"""What ``swarmloco`` tells a user about itself: --version, ``config show`` (commented TOML that loads back as the same
config, the form ``swarm create`` writes), the choices of Literal options in --help, and the ETA of progress lines."""

import dataclasses
import importlib.metadata
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from peer.cli import app
from peer.cli_common import progress_line
from peer.launch import progress_line as peer_progress_line
from peer.progress import elapsed_and_eta, format_duration
from swarm.config import OUTER_CHOICES, SwarmConfig, class_docs, config_from_dict, dumps_config, load_config
from swarm.events import Stamp, TrainerProgress
from swarm.node.config import ROLES
from swarm.sim.simulate import ROUTINGS


def swarmloco(*args: str) -> Result:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})  # wide: rich truncates long choice lists
    assert result.exit_code == 0, result.output
    return result


def test_version_is_the_installed_distributions() -> None:
    assert swarmloco("--version").output == f"swarmloco {importlib.metadata.version('swarmloco')}\n"


def test_the_console_script_answers_version_without_loading_torch() -> None:
    """``swarmloco --version`` took ~4 s when the script imported every command (and torch and hivemind) first."""
    check = "import sys; from peer.entry import main; main(); assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", check, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"swarmloco {importlib.metadata.version('swarmloco')}\n"


def test_config_show_prints_the_default_commented_and_it_loads_back() -> None:
    shown = swarmloco("config", "show").output
    assert config_from_dict(tomllib.loads(shown)) == SwarmConfig()
    assert "# tokens per sample; at most model.max_seq_len\nseq_len = 128\n" in shown
    assert "# one of: none, diloco, sparseloco, noloco\nmethod = " in shown  # a Literal's choices, from its type
    assert f"swarm {SwarmConfig().swarm_id}" in shown


def test_config_show_of_a_file_is_its_values_over_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "lab.toml"
    path.write_text('name = "lab"\n[train]\nseq_len = 64\n[codecs]\nactivations = "fp16"\n[inner]\nlr = 0.001\n')
    expected = load_config(path)
    assert expected != SwarmConfig() and expected.codecs.activations == "fp16"
    shown = swarmloco("config", "show", "--config", str(path)).output
    (tmp_path / "shown.toml").write_text(shown)
    again = load_config(tmp_path / "shown.toml")
    assert again == expected and again.hash() == expected.hash()
    assert "\nseq_len = 64\n" in shown and "\nlr = 0.001\n" in shown  # the file's values
    assert "\nmicrobatch_size = 4\n" in shown  # the defaults for the rest


def test_every_config_field_has_a_meaning() -> None:
    """Each field of the tree is commented beside it in its source: `config show` and swarm.toml explain it."""

    def sections(cls: type) -> list[type]:
        nested = [hint for hint in typing.get_type_hints(cls).values() if dataclasses.is_dataclass(hint)]
        return [cls, *(s for n in nested for s in sections(n))]  # type: ignore[arg-type]  # type hints: classes, not instances

    for section in sections(SwarmConfig):
        _, docs = class_docs(section)
        leaves = {name for name, hint in typing.get_type_hints(section).items() if not dataclasses.is_dataclass(hint)}
        assert leaves <= set(docs), (section.__name__, sorted(leaves - set(docs)))


def test_swarm_create_writes_the_commented_form(tmp_path: Path) -> None:
    swarmloco("swarm", "create", "--name", "demo", "--out", str(tmp_path / "demo"))
    written = (tmp_path / "demo" / "swarm.toml").read_text()
    cfg = load_config(tmp_path / "demo" / "swarm.toml")
    assert cfg.name == "demo" and written == dumps_config(cfg, commented=True)
    assert "# width of the residual stream\nd_model = 128\n" in written
    assert swarmloco("config", "show", "--config", str(tmp_path / "demo" / "swarm.toml")).output == written


@pytest.mark.parametrize(
    "command,choices",
    [(["run"], ROLES), (["simulate"], OUTER_CHOICES), (["simulate"], ROUTINGS)],
)
def test_help_lists_the_choices_of_literal_options(command: list[str], choices: tuple[str, ...]) -> None:
    assert f"<{'|'.join(choices)}>" in swarmloco(*command, "--help").output


@pytest.mark.parametrize(
    "seconds,text", [(0, "0s"), (7.4, "7s"), (59.6, "1m00s"), (65, "1m05s"), (3599, "59m59s"), (7380, "2h03m")]
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    "elapsed,done,total,text",
    [
        (12.0, 20, 120, "12s, ETA 1m00s"),  # 0.6 s a step, 100 steps left
        (2.0, 1, 2, "2s, ETA 2s"),
        (30.0, 1, 1000, "30s, ETA 8h19m"),
        (5.0, 0, 10, "5s"),  # no pace yet
        (90.0, 10, 10, "1m30s"),  # done
    ],
)
def test_elapsed_and_eta(elapsed: float, done: int, total: int, text: str) -> None:
    assert elapsed_and_eta(elapsed, done=done, total=total) == text


def test_progress_lines_end_with_the_eta() -> None:
    local = {"step": 5, "tokens": 10240, "train_loss": 4.7, "val_loss": 4.6, "elapsed_s": 24.0, "tokens_per_s": 426.7}
    assert progress_line(5, 20, local).endswith("0.4k tok/s  24s, ETA 1m12s")
    peer = TrainerProgress(
        stamp=Stamp(time=1.0, peer="trainer-0"),
        step=10,
        tokens=102000,
        train_loss=4.2,
        tokens_per_s=5100.0,
        elapsed_s=20.0,
        lr=1e-3,
        grad_norm=1.0,
    )
    line = peer_progress_line(peer, 100)
    assert line.startswith("[trainer-0] step 10/100") and line.endswith("  20s, ETA 3m00s")
