"""Losing a whole stage: CheckFree recovery against checkpoint rollback and against no failure, in a real local swarm.

The same swarm runs three times: a trainer, one server for each of 3 middle stages, and a spare
second server of stage 1 — every peer a separate ``swarmloco run`` process on loopback.
Stage 1's two servers rebalance (in the CheckFree run), so the least loaded of them can move.

- ``none``: no failure.
- ``checkfree``: the stage-2 server is SIGKILLed (``swarmtest/faults.py``, keyed by its own inner step)
  at step ``--kill-at``; the least-loaded stage-1 server moves, rebuilds stage 2 from stages 1 and
  3 (``swarm/recovery/rebuild.py``) and serves it.
- ``checkpoint``: the stage-2 server writes its stage state every ``--checkpoint-every`` inner steps;
  the same kill, and a new stage-2 server is started at once (as a supervisor would) and loads
  that file: the stage rolls back to its last checkpoint. Every server is pinned, so none rebuilds.

Meanwhile the trainer skips the missing stage. Per scenario: ``recovery_s`` (kill to the first
microbatch the new stage-2 server serves), ``val_loss`` after ``--steps`` steps (equal tokens: a
step counts only completed microbatches), ``time_to_target_s`` (training start to the first
validation pass at or below the target: the no-failure run's validation loss at 80% of its steps)
and ``wall_s``. The replicas of a stage average their weights every ``--outer-every`` steps (a
lossless outer step that leaves a lone replica as it is); without it stage 1's two replicas would
drift apart, and the rebuild would merge whichever of them it downloads.

    python scripts/bench_recovery.py --json bench-recovery.json                # ~8 min on 2 cores
    python scripts/bench_recovery.py --steps 200 --kill-at 80 --repeats 3     # medians of 3 runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from compress.config import CodecConfig
from optim.config import InnerOptimConfig, OuterOptimConfig
from peer.launch import spawn_peer, stop_processes, wait_for_address
from swarm.cli_fields import add_field_arguments
from swarm.config import SwarmConfig, TimeoutConfig, TrainConfig, TrainerOptions
from swarm.config_toml import save_config
from swarm.events import Event, Progress, Recovered, Rollback, of_kind, read_events
from swarm.faults import FaultSchedule
from swarm.model.stages import StagesConfig
from swarm.model.transformer import ModelConfig
from swarm.node.config import PeerConfig
from swarmtest.faults import FaultInjector

SCENARIOS = ("none", "checkfree", "checkpoint")
TARGET_RECOVERY_S = 30.0
TARGET_LOSS_GAP = 0.03  # val loss after recovery within 3% of the no-failure run
TARGET_FRACTION = 0.8  # the target val loss: the no-failure run's at 80% of its steps
VICTIM = "stage2-a"


def bench_config(steps: int, outer_every: int) -> SwarmConfig:
    # Outer step: plain averaging of the replicas every H steps (DiLoCo with outer lr 1, no momentum, fp32): it keeps stage 1's
    # two replicas in agreement and leaves a stage with one replica exactly as plain training would
    outer = (
        OuterOptimConfig(
            warm_start_steps=0, method="diloco", inner_steps=outer_every, diloco_lr=1.0, diloco_momentum=0.0
        )
        if outer_every
        else OuterOptimConfig(method="none")
    )
    return SwarmConfig(
        model=ModelConfig(d_model=128, n_layers=6, n_heads=4, max_seq_len=128),
        stages=StagesConfig(num_stages=3),
        train=TrainConfig(seq_len=128, microbatch_size=8, inner_batch=8),
        inner=InnerOptimConfig(warmup_steps=20, total_steps=steps),
        outer=outer,
        codecs=CodecConfig(pseudo_gradients="fp32"),
        timeouts=TimeoutConfig(rpc_s=10.0, matchmaking_s=2.0, announce_period_s=1.0, record_ttl_s=4.0),
    )


def records(out: Path, name: str) -> list[Event]:
    return read_events(out / f"{name}.jsonl")


def progress(out: Path, name: str, role: str) -> list[Progress]:
    return [r for r in of_kind(records(out, name), Progress) if r.role == role]


def run_scenario(scenario: str, cfg: SwarmConfig, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "swarm.toml")
    common = PeerConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], out=out, threads=1)
    server = dataclasses.replace(common, role="stage")
    victim = dataclasses.replace(server, stage=2)
    if scenario == "checkpoint":  # it writes a checkpoint, which its restart loads
        victim = dataclasses.replace(
            victim, stage_checkpoint=out / "stage2.ckpt", checkpoint_every=args.checkpoint_every
        )
    procs: dict[str, subprocess.Popen] = {}
    try:
        # The stage-1 servers may move only where CheckFree is the recovery (elsewhere they would rebuild the lost stage):
        # the least-loaded of the two does. 600 s: no throughput moves within a run; holes are looked for every second.
        movable = dataclasses.replace(server, stage=1, rebalance_period_s=600.0 if scenario != "checkpoint" else 0.0)
        first = dataclasses.replace(server, stage=3).to_argv()
        procs["stage3-a"] = spawn_peer("stage3-a", [*first, "--config", str(out / "swarm.toml")], out)
        join = [wait_for_address(procs["stage3-a"], out / "stage3-a.log", 120)]
        procs[VICTIM] = spawn_peer(VICTIM, dataclasses.replace(victim, initial_peers=join).to_argv(), out)
        wait_for_address(procs[VICTIM], out / f"{VICTIM}.log", 120)  # serving before stage 1's movers look for holes
        for name in ("stage1-a", "spare"):
            procs[name] = spawn_peer(name, dataclasses.replace(movable, initial_peers=join).to_argv(), out)
        trainer = dataclasses.replace(
            common,
            role="trainer",
            steps=args.steps,
            trainer=TrainerOptions(eval_every=args.eval_every),
            data=list(args.data or ()),
            initial_peers=join,
        )
        procs["trainer-0"] = spawn_peer("trainer-0", trainer.to_argv(), out)
        schedule = FaultSchedule.parse(f"{VICTIM}@step={args.kill_at}" if scenario != "none" else "")
        injector = FaultInjector(
            schedule, {VICTIM: procs[VICTIM]}, kill=lambda pid, sig: os.killpg(pid, sig)
        )  # the whole peer
        killed_at = None
        while procs["trainer-0"].poll() is None:
            steps = [r["inner_steps"] for r in progress(out, VICTIM, "stage") if "inner_steps" in r]
            if injector.poll({VICTIM: steps[-1]} if steps else {}):
                killed_at = time.time()
                print(f"  {scenario}: killed {VICTIM} at its step {steps[-1]}", flush=True)
                if (
                    scenario == "checkpoint"
                ):  # restarted at once; it loads the checkpoint once the stage has no live record
                    procs["stage2-b"] = spawn_peer(
                        "stage2-b", dataclasses.replace(victim, initial_peers=join).to_argv(), out
                    )
            time.sleep(0.2)
        if procs["trainer-0"].returncode != 0:
            raise RuntimeError(
                f"{scenario}: the trainer exited with {procs['trainer-0'].returncode}; see {out / 'trainer-0.log'}"
            )
    finally:
        stop_processes(procs.values())
    return summarise(scenario, out, killed_at)


def summarise(scenario: str, out: Path, killed_at: float | None) -> dict[str, Any]:
    trained = progress(out, "trainer-0", "trainer")
    started = trained[0].time - trained[0]["elapsed_s"]  # training start, after every stage had a server
    evals = [
        {"step": r["step"], "tokens": r["tokens"], "t_s": r.time - started, "val_loss": r["val_loss"]}
        for r in trained
        if "val_loss" in r
    ]
    last = trained[-1]
    result: dict[str, Any] = {
        "scenario": scenario,
        "val_loss": last["val_loss"],
        "tokens": last["tokens"],
        "steps": last["step"],
        "wall_s": last.time - started,
        "failed": last["failed"],
        "skipped_hops": last["skipped_hops"],
        "evals": evals,
    }
    if killed_at is not None:
        result["killed_at_s"] = killed_at - started
        for peer in (
            "stage1-a",
            "spare",
            "stage2-b",
        ):  # whoever rebuilt stage 2 (CheckFree) or rolled it back (restart)
            if events := [r for r in records(out, peer) if isinstance(r, (Recovered, Rollback))]:
                served = [
                    r["first_served_at"]
                    for r in of_kind(records(out, peer), Progress)
                    if r.get("stage") == 2 and r.get("first_served_at")
                ]
                result.update(
                    recovered_by=peer,
                    recovery=events[0].to_record(),
                    recovery_s=served[0] - killed_at if served else None,
                )
    return result


def to_target(result: dict[str, Any], target: float, key: str) -> float | None:
    """``key`` (t_s or step) of the first validation pass at or below ``target``."""
    return next((e[key] for e in result["evals"] if e["val_loss"] <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_field_arguments(parser, PeerConfig, "steps", defaults={"steps": 300})  # the trainer's, per run
    parser.add_argument(
        "--kill-at", type=int, default=130, help="the stage-2 server's inner step at which it is killed"
    )
    # the checkpoint scenario's stage-2 server's; the trainer's validation every N steps (a multiple of 10)
    add_field_arguments(
        parser,
        PeerConfig,
        "checkpoint_every",
        "trainer.eval_every",
        defaults={"checkpoint_every": 50, "trainer.eval_every": 20},
    )
    parser.add_argument(
        "--outer-every",
        type=int,
        default=10,
        help="H: replicas of a stage average their weights every H steps (0: never)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per scenario; the table shows medians")
    add_field_arguments(parser, PeerConfig, "data")
    parser.add_argument(
        "--out", type=Path, default=None, help="keep the peers' logs here (default: a temporary directory)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    args = parser.parse_args()
    if not 0 < args.kill_at < args.steps:
        parser.error("--kill-at must fall inside the run")
    cfg = bench_config(args.steps, args.outer_every)
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SCENARIOS}
    for repeat in range(args.repeats):
        for scenario in SCENARIOS:
            print(f"run {repeat + 1}/{args.repeats}: {scenario}", flush=True)
            runs[scenario].append(run_scenario(scenario, cfg, args, root / f"{scenario}-{repeat}"))
    at = TARGET_FRACTION * args.steps
    target = statistics.median(next(e["val_loss"] for e in run["evals"] if e["step"] >= at) for run in runs["none"])
    records_out = []
    for scenario, results in runs.items():
        for repeat, result in enumerate(results):
            # steps_to_target as well: on a shared machine the wall clock also measures the neighbours' load
            records_out.append(
                {
                    **result,
                    "repeat": repeat,
                    "target_val_loss": target,
                    "time_to_target_s": to_target(result, target, "t_s"),
                    "steps_to_target": to_target(result, target, "step"),
                    "tokens_per_s": result["tokens"] / result["wall_s"],
                    "kill_at": args.kill_at if scenario != "none" else None,
                    "config_hash": cfg.hash(),
                }
            )
    none_loss = statistics.median(r["val_loss"] for r in records_out if r["scenario"] == "none")
    print(
        f"\ntarget val loss {target:.4f} (no-failure run at step {int(at)}); kill at step {args.kill_at}; "
        f"checkpoint every {args.checkpoint_every} steps; medians of {args.repeats} run(s)"
    )
    print(
        f"{'scenario':<11} {'recovery_s':>10} {'val_loss':>9} {'vs none':>8} {'time_to_target_s':>17} {'steps_to_target':>15} "
        f"{'wall_s':>7} {'tok/s':>6} {'failed':>6} {'skipped':>7}"
    )
    for scenario in SCENARIOS:
        rs = [r for r in records_out if r["scenario"] == scenario]
        med = lambda key: statistics.median(v) if (v := [r[key] for r in rs if r.get(key) is not None]) else None
        fmt = lambda v, spec: format("-", f">{spec.split('.')[0]}") if v is None else format(v, spec)
        loss = med("val_loss")
        print(
            f"{scenario:<11} {fmt(med('recovery_s'), '10.1f')} {loss:9.4f} {100 * (loss / none_loss - 1):+7.2f}% "
            f"{fmt(med('time_to_target_s'), '17.1f')} {fmt(med('steps_to_target'), '15.0f')} {med('wall_s'):7.1f} {med('tokens_per_s'):6.0f} "
            f"{fmt(med('failed'), '6.0f')} {fmt(med('skipped_hops'), '7.0f')}"
        )
    cf = [r for r in records_out if r["scenario"] == "checkfree"]
    ck = [r for r in records_out if r["scenario"] == "checkpoint"]
    med_of = lambda rs, key: statistics.median(r[key] if r.get(key) is not None else float("inf") for r in rs)
    checks = {
        "recovery within 30 s": med_of(cf, "recovery_s") <= TARGET_RECOVERY_S,
        "checkfree reaches the target sooner than rollback": med_of(cf, "time_to_target_s")
        < med_of(ck, "time_to_target_s"),
        "checkfree val loss within 3% of no failure": med_of(cf, "val_loss") <= (1 + TARGET_LOSS_GAP) * none_loss,
    }
    for what, ok in checks.items():
        print(f"{'PASS' if ok else 'MISS'}  {what}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"records": records_out, "checks": checks, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1
            )
        )
        print(f"wrote {args.json}; peer logs in {root}")


if __name__ == "__main__":
    main()
