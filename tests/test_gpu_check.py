"""scripts/gpu_check.py: its --cpu mode end to end (the GPU check's four steps at toy sizes, each a real subprocess),
and its plan at the real sizes (--dry-run: the configs load, nothing runs)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from swarm.events import OuterRound, of_kind, read_events

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def run_script(args: list[str], children: list[subprocess.Popen], timeout: float) -> tuple[int, str]:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    children.append(proc)  # reaped with everything it started, whatever the outcome
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"gpu_check.py {' '.join(args)} still running after {timeout}s")
    return proc.returncode, out


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_cpu_mode_runs_every_step_and_prints_one_table(tmp_path: Path, child_processes: list) -> None:
    code, out = run_script(["--cpu", "--out", str(tmp_path)], child_processes, timeout=400)
    assert code == 0, out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "cpu" and report["device"] == "cpu"
    rows = {row["key"]: row for row in report["rows"]}
    assert list(rows) == ["125m", "1b", "swarm", "swarm1x2"]
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["exit"] == 0 and row["steps_done"] == row["steps"], row
        assert row["loss_end"] < row["loss_start"], row
        assert row["tokens_per_s"] > 0 and row["wall_s"] < row["timeout_s"], row
        assert Path(row["log"]).exists()
    swarm = rows["swarm"]
    assert swarm["failed_hops"] == 0 and swarm["outer_rounds"] >= 1, swarm
    assert swarm["microbatches"]["completed"] == swarm["microbatches"]["started"] > 0
    # 1 trainer + 2 servers against train-local at the same shapes, in the same run; MFU n/a (no CPU peak stated)
    pair, local = rows["swarm1x2"], rows["125m"]
    assert pair["shape"].startswith(local["shape"]) and "1 trainer + 2 servers over 2 stages" in pair["shape"], pair
    assert pair["failed_hops"] == 0 and pair["versus"] == "125m"
    assert pair["ratio"] == pytest.approx(pair["tokens_per_s"] / local["tokens_per_s"]) and 0 < pair["ratio"] < 2
    assert all(row["mfu"] is None for row in rows.values()) and report["peak_tflops"] is None
    # K = 2: the two trainers' replicas of stage 0 met in their outer rounds
    stage0 = [
        record
        for name in ("trainer-0", "trainer-1")
        for record in of_kind(read_events(tmp_path / "swarm" / f"{name}.jsonl"), OuterRound)
        if record.outcome == "done"
    ]
    assert any(record.contributors == 2 for record in stage0), stage0
    # one table, printed and in the JSON: a header and a row per step
    table = report["table"]
    assert len(table) == 5 and table[0].split()[:4] == ["step", "tok/s", "MFU", "ratio"]
    assert f" n/a {pair['ratio']:5.2f} " in table[-1]  # the MFU and ratio columns
    assert all(line in out for line in table)
    assert all(line.rstrip().endswith("ok") for line in table[1:])


def test_dry_run_plans_the_real_sizes_within_eight_minutes(tmp_path: Path, child_processes: list) -> None:
    code, out = run_script(["--dry-run", "--out", str(tmp_path)], child_processes, timeout=100)
    assert code == 0, out
    assert "train-local 125m: 85.3M params, d 768 x 12 layers, bf16, microbatch 8 x 1024" in out
    assert "train-local 1b: 1009.1M params, d 2048 x 20 layers, bf16, microbatch 8 x 1024" in out
    assert "swarm 125m K=2: 85.3M params" in out and "2 trainers + 4 servers over 2 stages" in out
    assert "--device cuda" in out and "local --peers 6 --stages 2 --trainers 2 --steps 30" in out
    assert "swarm 125m 1x2: 85.3M params, d 768 x 12 layers, bf16, microbatch 8 x 1024" in out
    assert "1 trainer + 2 servers over 2 stages, no outer step" in out and "--compile auto" in out
    assert "local --peers 3 --stages 2 --trainers 1 --steps 30" in out
    assert sorted(p.name for p in tmp_path.glob("*.toml")) == ["125m.toml", "1b.toml", "swarm.toml", "swarm1x2.toml"]
    gpu_check = load_script()
    assert sum(step.timeout_s for step in gpu_check.plan(False, 8)) + gpu_check.STOP_GRACE_S <= gpu_check.BUDGET_S
    assert gpu_check.BUDGET_S <= 8 * 60


def test_mfu_counts_six_n_and_attention_against_the_gpus_peak(tmp_path: Path) -> None:
    gpu_check = load_script()
    from swarm.config import SwarmConfig, derive_config
    from swarm.model.sizing import model_parameters

    cfg = derive_config(SwarmConfig(), {"model.preset": "125m", "train.seq_len": 1024, "stages.num_stages": 2})
    embedding = 256 * 768
    expected = 6 * (model_parameters(cfg.model) - embedding) + 12 * 12 * 768 * 1024
    assert gpu_check.flops_per_token(cfg) == expected
    records = [  # the first window is warm-up; validation time is left out
        {"step": 10, "tokens": 1000, "elapsed_s": 10.0, "eval_s": 1.0, "train_loss": 5.0, "val_loss": 5.0},
        {"step": 20, "tokens": 3000, "elapsed_s": 13.0, "eval_s": 2.0, "train_loss": 4.0, "val_loss": 4.0},
    ]
    records[-1]["tokens_per_s"] = 3000 / 13.0
    result = gpu_check.train_local_result(records, cfg, peak_tflops=989.0)
    assert result["tokens_per_s"] == pytest.approx(2000 / 2.0)
    assert result["mfu"] == pytest.approx(expected * 1000 / 989e12)
    assert gpu_check.peak_for("NVIDIA H100 80GB HBM3", None) == 989.0
    assert gpu_check.peak_for("NVIDIA H200", None) == 989.0
    assert gpu_check.peak_for("NVIDIA A10", None) is None and gpu_check.peak_for("NVIDIA A10", 125.0) == 125.0


def load_script() -> ModuleType:
    """The script as a module (once)."""
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        assert spec and spec.loader
        sys.modules["gpu_check"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]
