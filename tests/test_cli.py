"""What ``swarmloco`` tells a user about itself: --version, ``config show`` (commented TOML that loads back as the same
config, the form ``swarm create`` writes), the choices of Literal options in --help, and the ETA of progress lines."""

import argparse
import dataclasses
import importlib.metadata
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from compress.config import CodecConfig
from optim.config import InnerOptimConfig, OuterOptimConfig
from peer.cli import app
from peer.cli_common import progress_line
from peer.config_options import ConfigOption, field_options
from peer.launch import progress_line as peer_progress_line
from peer.local_swarm import LocalSwarm
from peer.progress import elapsed_and_eta, format_duration
from swarm.cli_fields import (
    add_field_arguments,
    argument_values,
    cli_paths,
    cli_spec,
    config_argv,
    field_at,
    from_arguments,
)
from swarm.config import (
    OUTER_CHOICES,
    PathConfig,
    SwarmConfig,
    TrainConfig,
    TrainerOptions,
    config_from_dict,
    derive_config,
)
from swarm.config_toml import class_docs, dumps_config, load_config
from swarm.dht.reachability import REACHABILITY_MODES
from swarm.events import Stamp, TrainerProgress
from swarm.faults import FaultSchedule
from swarm.model.compiling import COMPILE_MODES
from swarm.model.stages import StagesConfig
from swarm.node.config import ROLES, PeerConfig
from swarm.sim.centralized import CentralizedRun
from swarm.sim.simulate import ROUTINGS, SimulationConfig
from swarmtest.configs import DATA


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


def parsed_run(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> PeerConfig:
    """The PeerConfig ``swarmloco run ARGV`` would start its peer with (the peer itself not run)."""
    import peer.launch

    started: list[PeerConfig] = []
    monkeypatch.setattr(peer.launch, "run_peer", lambda peer, **kwargs: started.append(peer))
    swarmloco("run", *argv)
    (config,) = started
    return config


ROUND_TRIPS = [
    PeerConfig(),
    *(PeerConfig(role=role) for role in ROLES),
    *(PeerConfig(role="trainer", reachability=mode) for mode in REACHABILITY_MODES),
    *(PeerConfig(compile=mode) for mode in COMPILE_MODES),
    PeerConfig(role="full", serve=True, steps=7, wait_for_replicas=2, keep_graph_mb=0, swarm_name="demo"),
    PeerConfig(
        role="stage",
        stage=2,
        initial_peers=["/ip4/10.0.0.1/tcp/4/p2p/12D3a", "/ip4/10.0.0.2/tcp/5/p2p/12D3b"],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        announce_maddrs=["/ip4/1.2.3.4/tcp/9"],
        identity=Path("peer.id"),
        name="stage2-a",
        out=Path("runs/x"),
        max_pending=3,
        rebalance_period_s=0.0,
        stage_checkpoint=Path("s2.pt"),
        checkpoint_every=4,
        threads=2,
        device="cpu",
    ),
    PeerConfig(
        role="trainer",
        data=["a.txt", "docs/*.md"],
        tokenizer=Path("tok.json"),
        data_shard=1,
        seed=3,
        steps=30,
        wait_for_stages_s=7.25,
        trainer=TrainerOptions(in_flight=2, max_staleness=1, check_rate=0.0, probe_rate=0.125, eval_every=5),
        faults=FaultSchedule.parse("trainer-0@step=4,stage1-a@step=9"),
    ),
]


@pytest.mark.parametrize("config", ROUND_TRIPS, ids=lambda c: " ".join(c.to_argv()) or "defaults")
def test_a_peer_config_turns_back_into_the_run_argv_that_recreates_it(
    config: PeerConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parsed_run(config.to_argv(), monkeypatch) == config


def test_the_argv_holds_only_what_differs_from_the_defaults() -> None:
    assert PeerConfig().to_argv() == []
    assert PeerConfig(role="stage", stage=1, steps=100).to_argv() == ["--role", "stage", "--stage", "1"]
    assert PeerConfig(trainer=TrainerOptions(eval_every=5)).to_argv() == ["--eval-every", "5"]


@pytest.mark.parametrize(
    "config,field",
    [
        (PeerConfig(trainer=TrainerOptions(max_attempts=5)), "trainer.max_attempts"),  # no option sets it
        (PeerConfig(host_maddrs=[]), "host_maddrs"),  # a list the command line cannot empty
    ],
)
def test_a_config_no_argv_recreates_is_refused_by_name(config: PeerConfig, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        config.to_argv()


class Stop(Exception):
    """Raised where a test has seen what a command would run, before it runs it."""


COMMAND_CONFIGS = [("local", LocalSwarm), ("simulate", SimulationConfig), ("train-local", CentralizedRun)]


@pytest.mark.parametrize("command,section", COMMAND_CONFIGS)
def test_a_commands_options_and_their_defaults_come_from_its_config_dataclass(command: str, section: type) -> None:
    """Every field with ``cli`` metadata is an option, its help and default the field's, written there only."""
    options = field_options(section)
    assert options, f"{section.__name__} declares no options"
    text = " ".join(swarmloco(command, "--help").output.split())  # rich wraps the help: compare words
    for option in options:
        flag = option.flags[0].split("/")[0]
        assert flag in text and " ".join(option.help.split()[:4]) in text, flag
        assert f"[default: {option.default}]" in text or isinstance(option.default, bool) or option.default is None


def test_simulate_builds_its_simulation_config_from_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import swarm.sim.simulate

    seen: list[SimulationConfig] = []

    def simulate(cfg: SwarmConfig, sim: SimulationConfig, *args: object, **kwargs: object) -> None:
        seen.append(sim)
        raise Stop

    monkeypatch.setattr(swarm.sim.simulate, "simulate", simulate)
    for args in (["--data", DATA], ["--data", DATA, "-k", "3", "--full", "1", "--tokens", "1000", "--no-wire-zstd"]):
        result = CliRunner().invoke(app, ["simulate", *args, "--routing", "sticky", "--outer", "ddp"])
        assert isinstance(result.exception, Stop), result.output
    assert seen == [
        SimulationConfig(routing="sticky", mode="ddp"),  # the dataclass's defaults: 500,000 tokens
        SimulationConfig(replicas=3, full=1, tokens=1000, wire_zstd=False, routing="sticky", mode="ddp"),
    ]


def test_local_builds_its_layout_and_every_peers_config_from_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import peer.launch

    seen: list[tuple[LocalSwarm, PeerConfig]] = []

    def launch(layout: LocalSwarm, *, peer: PeerConfig, **kwargs: object) -> int:
        seen.append((layout, peer))
        return 0

    monkeypatch.setattr(peer.launch, "launch_local", launch)
    swarmloco("local")
    args = ["--peers", "4", "--trainers", "2", "--join-after", "5", "--full", "1", "--joiners", "1"]
    swarmloco("local", *args, "--data", "a.txt", "--data", "b", "--device", "cpu", "--compile", "off")
    assert seen == [
        (LocalSwarm(), PeerConfig()),
        (
            LocalSwarm(peers=4, trainers=2, join_after_s=5.0, full=1, joiners=1),
            PeerConfig(data=["a.txt", "b"], device="cpu", compile="off"),
        ),
    ]
    result = CliRunner().invoke(app, ["local", "--peers", "2", "--stages", "2"])
    assert result.exit_code == 2 and "use --peers 3 or more" in result.output


def test_train_local_builds_its_run_from_its_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import swarm.sim.centralized

    seen: list[dict[str, object]] = []

    def train(*args: object, **kwargs: object) -> None:
        seen.append(kwargs)
        raise Stop

    monkeypatch.setattr(swarm.sim.centralized, "train_centralized", train)
    for args in ([], ["--steps", "7", "--log-every", "3", "--compile", "off"]):
        result = CliRunner().invoke(
            app, ["train-local", "--data", DATA, "--out", str(tmp_path), "--device", "cpu", *args]
        )
        assert isinstance(result.exception, Stop), result.output
    assert [(kw["steps"], kw["log_every"], kw["compile"]) for kw in seen] == [(300, 25, "auto"), (7, 3, "off")]


def test_config_argv_recreates_any_commands_dataclass(monkeypatch: pytest.MonkeyPatch) -> None:
    """``config_argv`` is not ``run``'s alone: a LocalSwarm comes back from ``swarmloco local`` given its argv."""
    import peer.launch

    seen: list[LocalSwarm] = []
    monkeypatch.setattr(peer.launch, "launch_local", lambda layout, **kwargs: seen.append(layout) or 0)
    layouts = [LocalSwarm(), LocalSwarm(peers=0, trainers=0, full=2, stages=3), LocalSwarm(joiners=2, join_after_s=0.5)]
    for layout in layouts:
        swarmloco("local", *config_argv(layout))
    assert seen == layouts
    assert config_argv(SimulationConfig(wire_zstd=False, replicas=3)) == ["--replicas", "3", "--no-wire-zstd"]


def field_parser(root: type, **defaults: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_field_arguments(parser, root, *cli_paths(root), defaults=defaults)
    return parser


@pytest.mark.parametrize("config", ROUND_TRIPS, ids=lambda c: " ".join(c.to_argv()) or "defaults")
def test_a_scripts_argparse_options_read_back_the_argv_a_config_turns_into(config: PeerConfig) -> None:
    """The benchmark scripts declare config fields with ``add_field_arguments``: the same flags as ``swarmloco run``."""
    argv = config_argv(dataclasses.replace(config, swarm_name=PeerConfig().swarm_name))
    args = field_parser(PeerConfig).parse_args(argv)
    given = argument_values(PeerConfig, args, *cli_paths(PeerConfig))
    assert PeerConfig.from_flat(given) == dataclasses.replace(config, swarm_name=PeerConfig().swarm_name)


@pytest.mark.parametrize("section", [LocalSwarm, SimulationConfig, CentralizedRun, TrainerOptions])
def test_a_scripts_argparse_options_default_to_the_dataclass_and_build_it_back(section: type) -> None:
    """No option given: the dataclass's defaults, as its command's; its flag, help and default are the field's."""
    parser = field_parser(section)
    assert from_arguments(section, parser.parse_args([]), *cli_paths(section)) == section()
    help_text = " ".join(parser.format_help().split())
    for option in field_options(section):
        assert option.flags[0].split("/")[0] in help_text and " ".join(option.help.split()[:4]) in help_text


def test_a_scripts_own_defaults_and_least_values() -> None:
    parser = field_parser(LocalSwarm, steps=60, join_after_s=None)
    args = parser.parse_args(["--trainers", "2", "--peers", "5", "--full", "1"])
    assert (args.steps, args.join_after) == (60, None)
    assert from_arguments(LocalSwarm, args, *cli_paths(LocalSwarm)) == LocalSwarm(peers=5, trainers=2, full=1, steps=60)
    assert from_arguments(LocalSwarm, args, "stages", peers=4) == LocalSwarm(peers=4)  # only the fields named
    with pytest.raises(argparse.ArgumentError, match="at least 1"):
        parser.parse_args(["--steps", "0"])
    sim = field_parser(SimulationConfig).parse_args(["-k", "3", "--no-wire-zstd", "--routing", "sticky"])
    assert from_arguments(SimulationConfig, sim, *cli_paths(SimulationConfig)) == SimulationConfig(
        replicas=3, wire_zstd=False, routing="sticky"
    )
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        field_parser(SimulationConfig).parse_args(["--routing", "nowhere"])
    with pytest.raises(ValueError, match="no command-line option"):
        add_field_arguments(argparse.ArgumentParser(), TrainerOptions, "max_attempts")


def test_the_swarm_configs_fields_a_command_takes_declare_their_option_on_the_field() -> None:
    """SwarmConfig's command-line fields (the compress and optim sections' too) carry ``cli`` metadata: a config off its
    defaults in them turns into options that a parser built from the fields reads back, limits checked while parsing."""
    cfg = SwarmConfig(
        train=TrainConfig(seq_len=64, microbatch_size=2, inner_batch=8, precision="bf16"),
        codecs=CodecConfig(activations="fp16", gradients="int4", pseudo_gradients="fp32"),
        inner=InnerOptimConfig(lr=1e-3, warmup_steps=5),
        outer=OuterOptimConfig(method="diloco", inner_steps=5, warm_start_steps=0),
        paths=PathConfig(skip_ratio=0.25, max_swaps=1),
        stages=StagesConfig(num_stages=2),
    )
    argv = config_argv(cfg)
    assert argv[:4] == ["--stages", "2", "--seq-len", "64"] and "-H" not in argv and "--inner-steps" in argv
    args = field_parser(SwarmConfig).parse_args(argv)
    assert derive_config(SwarmConfig(), argument_values(SwarmConfig, args, *cli_paths(SwarmConfig))) == cfg
    for bad, why in ((["--skip", "0.995"], "at most 0.99"), (["-H", "0"], "at least 1"), (["--act-codec", "gzip"], "")):
        with pytest.raises(argparse.ArgumentError, match=why or "invalid choice"):
            field_parser(SwarmConfig).parse_args(bad)


def test_a_script_keeps_its_own_flag_for_a_field() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    flags = {"outer.inner_steps": ("--h",)}
    add_field_arguments(parser, SwarmConfig, "outer.inner_steps", defaults={"outer.inner_steps": 2}, flags=flags)
    args = parser.parse_args(["--h", "3"])
    assert args.h == 3 and argument_values(SwarmConfig, args, "outer.inner_steps", flags=flags) == {
        "outer.inner_steps": 3
    }
    assert "H: inner steps between outer steps" in parser.format_help()
    with pytest.raises(argparse.ArgumentError, match="at least 1"):
        parser.parse_args(["--h", "0"])


def test_plan_and_simulate_options_take_help_limits_and_choices_from_the_fields() -> None:
    """A command names a SwarmConfig field and its flag for it; the rest is the field's, and a note of its own."""
    from peer.commands.one_process import SIMULATE_CONFIG_OPTIONS
    from peer.commands.plan import PLAN_OPTIONS

    for option in (*PLAN_OPTIONS, *SIMULATE_CONFIG_OPTIONS):
        spec = cli_spec(field_at(SwarmConfig, option.field)[1])
        assert spec is not None and option.help.startswith(spec["help"]) and option.limits == spec["limits"]
    plan = " ".join(swarmloco("plan", "--help").output.split())
    assert "--codec" in plan and "Samples per microbatch. (default 8)" in plan and "[x>=1]" in plan
    simulate = " ".join(swarmloco("simulate", "--help").output.split())
    assert "-H" in simulate and "H: inner steps between outer steps. (default: the config's)" in simulate
    with pytest.raises(ValueError, match="no command-line option"):
        ConfigOption(field="train.seed")
