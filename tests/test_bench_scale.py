"""scripts/bench_scale.py: its plan at the real shapes (--dry-run: the configs derive, nothing runs) and how it reads a
swarm's records (step times from the trainer's rounds, bytes per token by kind, rounds, the joiner's download)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench_scale import JOINER, TRAINER, bench_config, declared_steps, parse_steps, swarm_summary
from swarm.events import Event, Metrics, OuterDeclared, OuterRound, Serving, Spawned, Stamp, StateDownload

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_scale.py"


def test_dry_run_plans_20m_and_125m_at_8_x_1024() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "20m: 21.4M parameters, 6 inner steps of 8 x 1024 tokens" in out, out
    assert "125m: 85.3M parameters, 5 inner steps of 8 x 1024 tokens" in out, out
    assert "all presets" in out


def test_steps_per_preset_and_declared_rounds() -> None:
    assert parse_steps(["8"]) == {"": 8}
    assert parse_steps(["20m=10", "125m=6"]) == {"20m": 10, "125m": 6}
    args = argparse.Namespace(seq_len=128, microbatch=8, precision="fp32", h=2, warm_start=3, set={})
    cfg = bench_config("tiny", args)
    assert declared_steps(cfg, 5) == [1, 2, 3, 5, 7]  # every step in the warm start, then every H


def record(t: float, peer: str, event: Event) -> Event:
    return event.stamped(Stamp(time=t, peer=peer, peak_rss_mb=500.0))


def done(stage: int, round: int, *, contributors: int, round_s: float, received_bytes: int) -> OuterRound:
    members = tuple(f"peer{i}" for i in range(contributors))
    return OuterRound(
        stage=stage,
        round=round,
        outcome="done",
        reason=None,
        group=contributors,
        contributors=contributors,
        contributor_ids=members,
        leader=members[0],
        outer_round=round + 1,
        global_hash="beef",
        round_s=round_s,
        received_bytes=received_bytes,
        dropped=(),
        clipped=(),
    )


def test_swarm_summary_reads_steps_bytes_rounds_and_the_download(tmp_path: Path) -> None:
    args = argparse.Namespace(seq_len=128, microbatch=8, precision="fp32", h=2, warm_start=0, set={})
    cfg = bench_config("tiny", args)
    step_tokens = 8 * 128
    metrics = {
        "step": 6,
        "tokens": 6 * step_tokens,
        "state": "training",
        "bytes_sent": {"activations": 6000, "gradients": 1000, "eval": 99},
        "bytes_received": {"activations": 2000, "gradients": 5000},
    }
    trainer = [
        record(0.0, TRAINER, Spawned()),
        *(record(t, TRAINER, OuterDeclared(stage=0, round=r, opened_at=t)) for r, t in enumerate([10.0, 14.0, 20.0])),
        record(21.0, TRAINER, Metrics(metrics=metrics)),
    ]
    rounds = [
        record(15.0, "stage1-0", done(1, 3, contributors=2, round_s=1.0, received_bytes=300)),
        record(15.0, JOINER, done(1, 3, contributors=2, round_s=3.0, received_bytes=100)),
        record(9.0, "stage2-0", done(2, 0, contributors=1, round_s=0.1, received_bytes=0)),
    ]
    joiner = [
        record(11.0, JOINER, Spawned()),
        record(12.5, JOINER, StateDownload(stage=1, reason="join", outer_round=2, download_s=0.5)),
        record(13.0, JOINER, Serving(stage=1, outer_round=2, global_hash="beef")),
    ]
    (tmp_path / "stage1-0.log").write_text("2026 WARNING [stage1-0] swarm: something\nfine\n")
    peers = {TRAINER: trainer, "stage1-0": rounds[:1], JOINER: joiner + rounds[1:2], "stage2-0": rounds[2:]}
    s = swarm_summary(cfg, peers, tmp_path)
    assert s["step_s_all"] == [2.0, 2.0, 3.0, 3.0]  # the first H steps left out
    assert s["step_s"] == 2.5 and s["tokens_per_s"] == pytest.approx(step_tokens / 2.5)
    assert s["bytes_per_token"] == {
        "activations": 8000 / (6 * step_tokens),
        "gradients": 6000 / (6 * step_tokens),
        "pseudo_gradients": 400 / (6 * step_tokens),
    }
    assert s["round_s"] == 2.0 and s["shared_rounds"] == 2 and s["round_members"] == 2 and s["round_s_alone"] == 0.1
    assert s["download_s"] == 0.5 and s["joiner_ready_s"] == 2.0
    assert s["warnings"] == {"stage1-0": ["2026 WARNING [stage1-0] swarm: something"]}
