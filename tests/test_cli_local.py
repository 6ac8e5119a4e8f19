"""End to end through the CLI in subprocesses: train-local, eval, sample, and clear errors."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optim.config import OuterOptimConfig
from peer.launch import LocalSwarm, local_config
from swarm.config import SwarmConfig
from swarm.config_toml import save_config
from swarm.events import OuterRound, Progress, of_kind, read_events
from swarm.model.transformer import Transformer
from swarm.recovery.checkpoint import load_checkpoint, save_checkpoint
from swarmtest.configs import tiny_config
from swarmtest.processes import descendants, swarmloco, wait_until


@pytest.fixture(scope="module")
def tiny_toml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config(
        stages=2, inner={"lr": 1e-2}, outer=OuterOptimConfig(warm_start_steps=0, method="sparseloco", inner_steps=10)
    )
    path = tmp_path_factory.mktemp("cfg") / "tiny.toml"
    save_config(cfg, path)
    return path


@pytest.fixture(scope="module")
def trained(
    tiny_toml: Path, tmp_path_factory: pytest.TempPathFactory, module_child_processes: list[subprocess.Popen]
) -> Path:
    out = tmp_path_factory.mktemp("run")
    (result,) = swarmloco(
        ["train-local", "--config", str(tiny_toml), "--steps", "60", "--log-every", "20", "--out", str(out)],
        children=module_child_processes,
    )
    assert result.returncode == 0, result.stderr
    assert "step 60/60" in result.stdout
    return out


@pytest.mark.timeout(240)  # the first test to use `trained` also waits for its train-local run (~120 s under load)
def test_train_local_writes_metrics_with_falling_validation_loss(trained: Path) -> None:
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [20, 40, 60]
    assert {"step", "tokens", "train_loss", "val_loss", "elapsed_s"} <= set(records[0])
    assert records[-1]["tokens"] == 60 * 8 * 64
    assert records[-1]["val_loss"] < records[0]["val_loss"] < 5.55  # ln(256): uniform over bytes


def test_train_local_s_schedule_follows_steps_unless_the_config_sets_it(
    trained: Path, tiny_toml: Path, tmp_path: Path, child_processes: list
) -> None:
    """The fixture's file leaves total_steps at its default (commented out), so its 60 steps are the schedule; a file
    that sets a shorter one keeps it, and the run warns once when its steps pass it."""
    assert load_checkpoint(trained / "model.pt")[0].inner.total_steps == 60
    pinned = tmp_path / "pinned.toml"
    pinned.write_text(tiny_toml.read_text().replace("# total_steps = 1000", "total_steps = 5"))
    (result,) = swarmloco(
        ["train-local", "--config", str(pinned), "--steps", "8", "--log-every", "8", "--out", str(tmp_path / "o")],
        children=child_processes,
    )
    assert result.returncode == 0, result.stderr
    assert load_checkpoint(tmp_path / "o" / "model.pt")[0].inner.total_steps == 5
    assert (result.stdout + result.stderr).count("the cosine schedule ended at step 5") == 1, result.stderr


def test_local_s_schedule_follows_steps_unless_the_config_sets_it(
    tiny_toml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process, the swarm itself not started: what ``swarmloco local`` hands the launcher."""
    import peer.launch
    from peer.cli import app

    launched: list[SwarmConfig] = []

    def launch(layout: LocalSwarm, *, config: SwarmConfig, schedule_set: bool, **kwargs: object) -> int:
        launched.append(local_config(config, layout, schedule_set=schedule_set))
        return 0

    monkeypatch.setattr(peer.launch, "launch_local", launch)
    pinned = tmp_path / "pinned.toml"
    pinned.write_text(tiny_toml.read_text().replace("# total_steps = 1000", "total_steps = 5"))
    for path in (tiny_toml, pinned):
        result = CliRunner().invoke(app, ["local", "--config", str(path), "--steps", "40", "--out", str(tmp_path)])
        assert result.exit_code == 0, result.output
    assert [cfg.inner.total_steps for cfg in launched] == [40, 5]


@pytest.mark.timeout(240)  # the first test to use `trained` also waits for its train-local run (~120 s under load)
def test_eval_and_sample_load_the_checkpoint(trained: Path, child_processes: list) -> None:
    (result,) = swarmloco(["eval", "--checkpoint", str(trained / "model.pt"), "--json"], children=child_processes)
    assert result.returncode == 0, result.stderr
    last = json.loads((trained / "metrics.jsonl").read_text().splitlines()[-1])
    assert json.loads(result.stdout)["val_loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    (result,) = swarmloco(
        ["sample", "--checkpoint", str(trained / "model.pt"), "--prompt", "import ", "--tokens", "40"],
        children=child_processes,
    )
    assert result.returncode == 0 and result.stdout.startswith("import ") and len(result.stdout) > len("import ") + 10


@pytest.mark.parametrize(
    "args,message",
    [
        (["eval", "--checkpoint", "/no/such/model.pt"], "does not exist"),
        (["train-local", "--data", "/no/such/dir", "--steps", "1"], "/no/such/dir"),
        (["train-local", "--config", "/no/such.toml", "--steps", "1"], "does not exist"),
    ],
)
def test_user_errors_are_one_clear_line(args: list[str], message: str, child_processes: list) -> None:
    (result,) = swarmloco(args, children=child_processes)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_binary_data_corrupt_checkpoints_and_unusable_paths_are_one_clear_line(
    tmp_path: Path, child_processes: list
) -> None:
    noise = bytes(range(256)) * 1000  # NUL and control bytes, invalid UTF-8
    for name in ("random.bin", "random.txt"):
        (tmp_path / name).write_bytes(noise)
    (tmp_path / "bad.pt").write_text("garbage\n")
    a_file = tmp_path / "a-file"  # where a folder must be
    a_file.write_text("")
    cfg = tiny_config()
    save_checkpoint(tmp_path / "model.pt", cfg, Transformer(cfg.model))
    cases = {
        "does not look like text": ["train-local", "--data", str(tmp_path / "random.bin"), "--steps", "1"],
        f"{tmp_path / 'random.txt'} does not look like text": [
            "train-local", "--data", str(tmp_path / "random.txt"), "--steps", "1", "--out", str(tmp_path / "o"),
        ],
        f"{tmp_path / 'bad.pt'} is not a swarmloco checkpoint (not a torch archive)": [
            "eval", "--checkpoint", str(tmp_path / "bad.pt"),
        ],
        f"cannot access {a_file}": ["swarm", "create", "--name", "x", "--out", str(a_file / "x")],
        f"cannot access {a_file}/x: Not a directory": [
            "train-local", "--out", str(a_file / "x"), "--steps", "1",
        ],
        f"cannot create {a_file}: a file of that name exists where a folder is needed": [
            "export", "--checkpoint", str(tmp_path / "model.pt"), "--out", str(a_file / "m.pt"),
        ],
    }  # fmt: skip
    for (message, args), result in zip(cases.items(), swarmloco(*cases.values(), children=child_processes)):
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(errors) == 1, (args, result.stderr)
        assert message in errors[0], (args, result.stderr)
        assert "Traceback" not in result.stderr and "weights_only" not in result.stderr


def test_help_lists_the_commands(child_processes: list) -> None:
    (result,) = swarmloco(["--help"], children=child_processes)
    assert result.returncode == 0
    assert all(cmd in result.stdout for cmd in ("train-local", "eval", "sample"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_swarm_runs_from_a_fresh_directory_and_lone_replicas_lose_nothing_in_outer_rounds(
    tiny_toml: Path, trained: Path, tmp_path: Path, child_processes: list
) -> None:
    """The main job as a newcomer runs it (default, relative --out); one replica per stage crosses outer rounds
    (H = 10, 60 steps) and ends where one process on the same tokens ends."""
    (result,) = swarmloco(
        ["local", "--config", str(tiny_toml), "--steps", "60"], children=child_processes, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = tmp_path / "runs" / "local"
    assert (out / "swarm.toml").exists() and "bytes on the wire: activations" in result.stdout
    address = next(line.split()[-1] for line in result.stdout.splitlines() if line.startswith("swarm address: "))
    assert f"swarmloco dashboard --initial-peers {address}" in result.stdout  # ready to paste while it runs
    for peer in ("trainer-0", "stage1-0", "stage2-0"):
        rounds = of_kind(read_events(out / f"{peer}.jsonl"), OuterRound)
        assert len(rounds) >= 3 and all(r.outcome == "done" and r.contributors == 1 for r in rounds), (
            peer,
            rounds,
        )
    swarm_val = [r for r in of_kind(read_events(out / "trainer-0.jsonl"), Progress) if "val_loss" in r][-1]["val_loss"]
    alone_val = json.loads((trained / "metrics.jsonl").read_text().splitlines()[-1])[
        "val_loss"
    ]  # train-local, 60 steps
    assert swarm_val <= 1.03 * alone_val, (
        swarm_val,
        alone_val,
    )  # before: each lone SparseLoCo round threw ~98% of Δ away
    # the model is left behind: the trainer's stage 0 and the servers' stages, as the last validation saw them
    # (through int8 boundaries there, uncompressed in eval)
    assert f"model saved: {out / 'model.pt'}" in result.stdout
    (evaluated,) = swarmloco(["eval", "--checkpoint", str(out / "model.pt"), "--json"], children=child_processes)
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["val_loss"] == pytest.approx(swarm_val, rel=0.02)
    # and the same model as a Hugging Face LLaMA folder (tests/test_hf_export.py checks such folders' logits)
    assert f"Hugging Face folder: {out / 'model-hf'}" in result.stdout
    assert sorted(p.name for p in (out / "model-hf").iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_local_swarm_sent_sigterm_stops_every_peer_it_started(
    tiny_toml: Path, tmp_path: Path, child_processes: list
) -> None:
    """A `timeout` or a service manager stops `swarmloco local` with SIGTERM: no peer may outlive it (they did)."""
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "peer",
            "local",
            "--config",
            str(tiny_toml),
            "--steps",
            "100000",
            "--out",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    child_processes.append(launcher)
    trainer = tmp_path / "trainer-0.jsonl"
    wait_until("the trainer to log", lambda: trainer.exists() and '"step"' in trainer.read_text(), 120)
    peers = descendants(launcher.pid)
    assert len(peers) >= 3
    launcher.send_signal(signal.SIGTERM)  # to the launcher alone, not its process group
    assert launcher.wait(timeout=60) != 0
    wait_until("every peer to exit", lambda: not [pid for pid in peers if running(pid)], 30)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, exited and waiting for its parent to reap it, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
