"""Model presets at real shapes: a real swarm against one process (train-local), by preset, in one run (issue 33).

For each preset (default 20m and 125m) at seq_len 1024 and microbatches of 8 (one microbatch per inner step), on the
same device, precision and torch threads (1 per process: what ``swarmloco local`` gives every peer), two
measurements one after the other, the same number of inner steps each (``STEPS``):

- **swarm**: ``swarmloco local`` on loopback (``peer.launch.launch_local``): 1 trainer and 2 stage servers, one per
  middle stage, SparseLoCo every ``--h`` = 2 inner steps with no warm start, ``timeouts.rpc_s`` 120 s. A lone
  replica's rounds have one member, so a **joiner** (``--role stage --stage 1``: pinned, as a ``--role auto``
  server may be moved by rebalancing mid-measurement) is started once the trainer trains (``--join-at-step`` 0;
  N: once it has taken N steps). It downloads stage 1's state (the state-download time), the trainer then spreads
  stage 1's microbatches over both servers, and the two meet in 2-member rounds (the outer-round time; H = 2 since
  each now steps on every other microbatch, and a replica joins a round once it has H/2 steps). It joins early
  because at 125m a late joiner risks its own memory check: a stage's estimate is 12.6 GiB at 8 x 1024, and while
  a server computes a backward (~4 GB of activations: 1 GB per sample over 12 blocks, measured at 2 x 1024) less
  may be free on this 23 GiB machine. The pipeline is synchronous, so one peer computes at a time; a server
  recomputes its forward in the backward (no graph waits between calls), so the middle stages do 4/3 of one
  process' FLOPs: expect a ratio near 0.75 at best. Outer rounds and the joiner's download run on the other core.
- **one process**: ``swarmloco train-local``'s code (``follow_run``, its seed and data, ``train_centralized``) on
  the same config, in a spawned process of its own (its peak RSS is its own high-water mark); its final
  validation pass is cut to 8 tokens. train-local's memory check (``check_fits``) is run and reported, not obeyed:
  at 125m x 8 x 1024 its estimate (23.1 GiB) refuses to start on this 23 GiB machine, though the run needs about
  10 GB (a 2 x 1024 microbatch measured, scaled to 8).

Reported per preset, in one table (a column per preset) and ``--json``: tokens/s of each and their ratio (swarm /
one process), both from the median time per inner step after the first (warm-up); peak RSS per process beside the
estimate (``swarm/model/sizing.py``); the median 2-member outer-round time (declaration to install; lone rounds'
apart); the joiner's state download (and spawn to serving); wire bytes per training token by kind.

How each number is read:

- Step times, swarm: where each inner step ended, from the trainer's records: exactly where its stage-0 rounds were
  declared (every H steps, logged within 0.25 s), and within 2.5 s where two consecutive ``metrics`` records
  (every 5 s) show it taking one step (at these shapes, every step); the time between two known ends is spread
  over the steps between. The first step is left out (its start is only known within 5 s). One process: the
  time between the inner steps' first ``next(batches)`` calls, the first step left out.
- Bytes per token: activations and activation gradients are the trainer's ``bytes_sent`` + ``bytes_received`` by
  kind in its ``metrics`` records (``swarm/dht/metrics.py``; every pipeline frame goes to or from the trainer, and
  validation traffic is its own kind, left out); pseudo-gradients are the ``received_bytes`` of every peer's
  ``outer_round`` records (what each member received in its rounds), summed. All over the trainer's training
  tokens, so pseudo-gradient bytes per token scale with 1/H.
- The swarm trainer's final validation pass (256 sequences through the pipeline: as long as ~10 inner steps at these
  shapes) measures nothing here: once the trainer has taken its last step and the servers' open rounds have ended,
  it is stopped (SIGTERM, a clean leave) and ``launch_local`` stops the servers. Its last progress record (with the
  failed hops) is then never written, so each peer's WARNING/ERROR log lines are kept instead (in the JSON; the
  trainer's "waiting for servers" at the start is one).
- Peak RSS: ``peak_rss_mb`` of each peer's records (its own ``ru_maxrss``); the one-process run's ``ru_maxrss``.

The lead's command, on a quiet machine (2 cores: about 25 minutes, ~7 for 20m and ~18 for 125m, at 60 GFLOP/s per
thread; ``--dry-run`` prints the plan and this estimate, ``--steps 125m=6`` adds ~3.5 minutes):

    python scripts/bench_scale.py --json docs/data/scale.json --keep runs/bench-scale

Smaller looks:

    python scripts/bench_scale.py --presets tiny --seq-len 128 --steps 60           # a smoke run, 2-3 min
    python scripts/bench_scale.py --presets 20m --seq-len 256 --steps 6             # 20m's state and rounds, ~4 min
    python scripts/bench_scale.py --presets 125m --device cuda --precision bf16      # on a GPU machine
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from peer import launch, logs
from peer.launch import LocalSwarm, launch_local, stop_processes
from swarm.cli_fields import add_field_arguments, from_arguments
from swarm.config import SwarmConfig, follow_run, parse_overrides
from swarm.events import (
    Event,
    Metrics,
    OuterDeclared,
    OuterRound,
    Progress,
    Serving,
    Spawned,
    StateDownload,
    of_kind,
)
from swarm.hardware import available_memory, describe, resolve_device
from swarm.model.sizing import StageDoesNotFit, StageFootprint, check_fits, model_parameters
from swarm.node.config import PeerConfig
from swarmtest.bench import Peers, preset_config, read_peers

# the config fields this benchmark's options set (their flags, help and limits the fields'), besides --presets
CONFIG_FIELDS = (
    "outer.inner_steps",
    "outer.warm_start_steps",
    "train.seq_len",
    "train.microbatch_size",
    "train.precision",
)

# Inner steps per preset when --steps does not say: the default run (20m and 125m at 8 x 1024) takes ~25 min on two
# quiet cores (module docstring). The joiner is in from about the second step; with H = 2 its first 2-member round
# comes about the third.
STEPS = {"tiny": 30, "20m": 6, "125m": 5}
DEFAULT_STEPS = 6
JOINER = "joiner-0"
TRAINER = "trainer-0"
RPC_S = 120.0  # a hop's timeout: a 125m stage's backward on one thread takes tens of seconds
# --dry-run's rate of one thread training at these shapes: measured 44-57 GFLOP/s for a 20m and a 125m microbatch
# (forward and backward, 2 x 1024 and 1 x 1024) and 40 for the tiny model's inner step on 2 cores shared at load 2.7;
# a quiet core is faster
GFLOPS = 60.0
PEER_FIELDS = ("device", "threads", "keep_graph_mb")  # PeerConfig's, as options: every peer's (swarm/node/config.py)
SETTLE_S = 60.0  # after the trainer's last step: the longest wait for the servers' open rounds to end


def bench_config(preset: str, args: argparse.Namespace) -> SwarmConfig:
    """The config both measurements run: the preset at the benchmark's shapes, SparseLoCo every H steps."""
    outer = {"outer.inner_steps": args.h, "outer.warm_start_steps": args.warm_start, "timeouts.rpc_s": RPC_S}
    return preset_config(
        preset, seq_len=args.seq_len, microbatch=args.microbatch, precision=args.precision, extra=outer | args.set
    )


def steps_for(preset: str, args: argparse.Namespace) -> int:
    return args.steps.get(preset, args.steps.get("", STEPS.get(preset, DEFAULT_STEPS)))


# ---------------------------------------------------------------- one process


def one_process(cfg: SwarmConfig, steps: int, device: str, threads: int) -> dict[str, Any]:
    """``swarmloco train-local``'s run (same config rule, seed, data, ``train_centralized``), timed per inner step;
    runs in a process of its own (``measure_one_process``). The final validation pass is one batch: it is not timed."""
    from peer.data import load_corpus
    from swarm.sim.centralized import train_centralized

    torch.set_num_threads(threads)
    cfg = follow_run(cfg, steps, schedule_set=False)
    compute = resolve_device(device)
    refused = refusal(StageFootprint.whole_model(cfg), compute)  # train-local would stop here; measured anyway
    torch.manual_seed(cfg.train.seed)
    corpus = load_corpus(None)
    kw = dict(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
    batches = corpus.sample_batches("train", seed=cfg.train.seed, **kw)
    inputs, targets = corpus.val_batches(num_sequences=1, **kw)[0]
    val = [(inputs[:1, :8], targets[:1, :8])]  # train_centralized's final validation pass: 8 tokens, not timed
    stamps: list[float] = []

    def timed(batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            stamps.append(time.perf_counter())
            yield batch

    logged: list[dict[str, float]] = []
    started = time.perf_counter()
    train_centralized(
        cfg,
        timed(batches),
        val,
        steps=steps,
        log_every=steps,
        on_log=lambda r: logged.append({**r, "at": time.perf_counter()}),
        device=compute,
    )
    last = logged[-1]
    per_step = cfg.train.inner_batch // cfg.train.microbatch_size
    starts = stamps[::per_step][:steps] + [last["at"] - last["eval_s"]]  # each step's start, and the last one's end
    step_s = [b - a for a, b in zip(starts, starts[1:])]
    return {
        "tokens": last["tokens"],
        "train_loss": last["train_loss"],
        "step_s_all": step_s,
        "setup_s": stamps[0] - started,  # model init, before the first step
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
        "refused": refused,
    }


def refusal(footprint: StageFootprint, device: torch.device) -> str | None:
    """What ``check_fits`` says of ``footprint`` on ``device`` now (None: it fits), printed as train-local prints it."""
    print(f"{describe(device)}: {footprint.describe()}", flush=True)
    try:
        check_fits(footprint, available=available_memory(device), device=describe(device))
    except StageDoesNotFit as e:
        print(f"train-local would refuse to start: {e}; measured anyway", flush=True)
        return str(e)
    return None


def measure_one_process(cfg: SwarmConfig, steps: int, args: argparse.Namespace) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        result = pool.submit(one_process, cfg, steps, args.device, args.threads).result()
    result["estimate_mb"] = StageFootprint.whole_model(cfg).total_bytes / 2**20
    return result | step_summary(result["step_s_all"][1:], cfg)


def step_summary(step_s: list[float], cfg: SwarmConfig) -> dict[str, Any]:
    """Median (and mean) time per inner step over the given steps, and the tokens/s it makes."""
    if not step_s:
        return {"step_s": None, "step_s_mean": None, "tokens_per_s": None}
    median = statistics.median(step_s)
    return {
        "step_s": median,
        "step_s_mean": statistics.mean(step_s),
        "tokens_per_s": cfg.train.inner_batch * cfg.train.seq_len / median,
    }


# ---------------------------------------------------------------- the swarm


@contextlib.contextmanager
def recording_spawns(procs: dict[str, subprocess.Popen]) -> Iterator[Callable[..., subprocess.Popen]]:
    """While inside: every peer ``launch_local`` spawns is also put in ``procs`` (to stop the trainer once its steps are
    done); yields the original ``spawn_peer`` (for the joiner)."""
    original = launch.spawn_peer

    def spawn(name: str, args: list[str], out: Path, **kw: Any) -> subprocess.Popen:
        procs[name] = original(name, args, out, **kw)
        return procs[name]

    launch.spawn_peer = spawn
    try:
        yield original
    finally:
        launch.spawn_peer = original


def declared_steps(cfg: SwarmConfig, count: int) -> list[int]:
    """The inner step at which each of a lone replica's first ``count`` rounds is declared (H, 1 in a warm start)."""
    steps, at = [], 0
    for _ in range(count):
        at += cfg.outer.horizon(at)
        steps.append(at)
    return steps


def trainer_step(cfg: SwarmConfig, records: list[Event]) -> int:
    """Inner steps the trainer has taken, as its records show them (its rounds at once, its metrics within 5 s)."""
    declared = [r for r in of_kind(records, OuterDeclared) if r.stage == 0]
    metrics = [r.metrics["step"] for r in of_kind(records, Metrics)]
    return max([0, *metrics, *declared_steps(cfg, len(declared))[-1:]])


def rounds_settled(peers: Peers) -> bool:
    """Every round a stage server declared has its outcome logged."""
    for name, records in peers.items():
        if name == TRAINER:
            continue
        declared = {(r.stage, r.round) for r in of_kind(records, OuterDeclared)}
        ended = {(r.stage, r.round) for r in of_kind(records, OuterRound)}
        if declared - ended:
            return False
    return True


class Conductor:
    """Watches a running local swarm from a thread: starts the joiner once the trainer trains and has taken ``join_at``
    steps, and stops the trainer once it has taken its last step (its validation pass measures nothing here) and the
    servers' open rounds have ended."""

    def __init__(self, cfg: SwarmConfig, out: Path, steps: int, join_at: int, joiner_args: list[str]) -> None:
        self.cfg, self.out, self.steps, self.join_at, self.joiner_args = cfg, out, steps, join_at, joiner_args
        self.procs: dict[str, subprocess.Popen] = {}
        self.address: str | None = None
        self.spawn: Callable[..., subprocess.Popen] | None = None
        self.stopped_trainer_at: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.shown = 0
        self.joiner_exit_shown = False
        self.last_step_at: float | None = None  # when the trainer was first seen past its last step

    def echo(self, line: str) -> None:
        if line.startswith("swarm address: "):
            self.address = line.split(": ", 1)[1].strip()
        if line.startswith(("local swarm", "swarm address", "[trainer", "trainer-0 exited", "swarm stopped")):
            print(f"  {line}", flush=True)

    def _run(self) -> None:
        while not self.done.wait(0.5):
            try:
                self._tick()
            except Exception as e:  # say so and look again: a dead watcher would leave the trainer to its validation
                print(f"  bench_scale: watching the swarm: {type(e).__name__}: {e}", flush=True)

    def _tick(self) -> None:
        trainer = self.procs.get(TRAINER)
        if trainer is None or trainer.poll() is not None or self.stopped_trainer_at is not None:
            return
        peers = read_peers(self.out)
        step = trainer_step(self.cfg, peers.get(TRAINER, []))
        if step > self.shown:
            self.shown = step
            print(f"  {TRAINER}: {step} of {self.steps} inner steps", flush=True)
        joiner = self.procs.get(JOINER)
        if joiner is not None and joiner.poll() is not None and not self.joiner_exit_shown:
            self.joiner_exit_shown = True
            tail = (self.out / f"{JOINER}.log").read_text(errors="replace").strip().splitlines()[-1:]
            print(f"  {JOINER} exited with status {joiner.returncode}: {' '.join(tail)}", flush=True)
        training = step > 0 or any(r.metrics["state"] == "training" for r in of_kind(peers.get(TRAINER, []), Metrics))
        if training and step >= self.join_at and joiner is None and self.address and self.spawn:
            args = [*self.joiner_args, "--initial-peers", self.address]
            self.procs[JOINER] = self.spawn(JOINER, args, self.out)
            print(f"  {JOINER} joins as a second server of stage 1", flush=True)
        if step >= self.steps:
            self.last_step_at = self.last_step_at or time.monotonic()
            if rounds_settled(peers) or time.monotonic() - self.last_step_at > SETTLE_S:
                self.stopped_trainer_at = time.time()
                trainer.send_signal(signal.SIGTERM)  # a clean stop: it leaves the swarm
                print(f"  {TRAINER}: stopped after its last step (its validation pass is not measured)", flush=True)


def measure_swarm(cfg: SwarmConfig, steps: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    layout = LocalSwarm(peers=3, stages=2, trainers=1, steps=steps)
    peer = from_arguments(PeerConfig, args, *PEER_FIELDS)
    joiner = dataclasses.replace(peer, role="stage", stage=1, host_maddrs=["/ip4/127.0.0.1/tcp/0"], out=out)
    joiner_args = [*joiner.to_argv(), "--log-level", logs.current_level()]
    conductor = Conductor(cfg, out, steps, args.join_at_step, joiner_args)
    started = time.perf_counter()
    try:
        with recording_spawns(conductor.procs) as spawn:
            conductor.spawn = spawn
            conductor.thread.start()
            code = launch_local(layout, out=out, config=cfg, peer=peer, export=False, echo=conductor.echo)
    finally:
        conductor.done.set()
        conductor.thread.join()
        if JOINER in conductor.procs:
            stop_processes([conductor.procs[JOINER]])
    wall_s = time.perf_counter() - started
    peers = read_peers(out)
    reached = trainer_step(cfg, peers.get(TRAINER, []))
    if reached < steps:
        raise RuntimeError(f"the trainer took {reached} of {steps} steps (exit {code}); logs in {out}")
    return swarm_summary(cfg, peers, out) | {"wall_s": wall_s, "exit": code}


def swarm_summary(cfg: SwarmConfig, peers: Peers, out: Path) -> dict[str, Any]:
    trainer = peers[TRAINER]
    gaps = swarm_step_times(cfg, trainer)
    metrics = [r.metrics for r in of_kind(trainer, Metrics)]
    final = max(metrics, key=lambda m: (m["step"], m["tokens"]))  # the last step's counters (training kinds only)
    tokens = final["tokens"]
    wire = {
        kind: final["bytes_sent"].get(kind, 0) + final["bytes_received"].get(kind, 0)
        for kind in ("activations", "gradients")
    }
    rounds = {name: of_kind(records, OuterRound) for name, records in peers.items()}
    done = [r for ended in rounds.values() for r in ended if r.outcome == "done"]
    shared = [r.round_s for r in done if r.contributors >= 2]
    alone = [r.round_s for r in done if r.contributors == 1 and r.stage != 0]
    wire["pseudo_gradients"] = sum(r.received_bytes for r in done)
    joiner = peers.get(JOINER, [])
    downloads = of_kind(joiner, StateDownload)
    download = next((r for r in downloads if r.download_s is not None), None)
    spawned = next((r.time for r in of_kind(joiner, Spawned)), None)
    serving = next((r.time for r in of_kind(joiner, Serving)), None)
    footprint = {stage: StageFootprint.of(cfg, stage) for stage in range(cfg.stages.num_stages + 1)}
    return {
        "tokens": tokens,
        "step_s_all": gaps,  # per step after the first round's H
        **step_summary(gaps, cfg),
        "peak_rss_mb": {
            name: max((r.stamp.peak_rss_mb or 0.0 for r in records if r.stamp), default=0.0)
            for name, records in peers.items()
        },
        "estimate_mb": {str(stage): f.total_bytes / 2**20 for stage, f in footprint.items()},
        "bytes_per_token": {kind: wire[kind] / tokens for kind in wire},
        "wire_bytes": wire,
        "outer_rounds": {
            name: sum(1 for r in ended if r.outcome == "done" and r.stage != 0)
            for name, ended in rounds.items()
            if name != TRAINER
        },
        "outer_not_done": sum(1 for ended in rounds.values() for r in ended if r.outcome != "done"),
        "round_s": statistics.median(shared) if shared else None,  # declaration to install, 2 or more members
        "round_s_alone": statistics.median(alone) if alone else None,
        "round_members": max((r.contributors for r in done), default=0),
        "shared_rounds": len(shared),
        "download_s": download and download.download_s,
        "download_round": download and download.outer_round,
        "state_mb": state_bytes(cfg, footprint[1].parameters) / 2**20,
        "joiner_ready_s": serving - spawned if serving and spawned else None,  # spawn to serving (download included)
        "joiner_downloads": len(downloads),
        "servers": {  # each server's last counters: microbatches served, backwards whose gradients were dropped
            name: {k: last.get(k) for k in (*SERVER_FIELDS, "time_split")}
            for name, records in peers.items()
            if (last := next((r for r in reversed(of_kind(records, Progress)) if r.role == "stage"), None))
        },
        "warnings": log_warnings(out),
    }


# each server's last counters: microbatches served, backwards whose gradients were dropped, backwards on a kept graph
SERVER_FIELDS = ("forward", "backward", "stale_backward", "stashed_backward", "refused", "graph_kept_backward")


def step_ends(cfg: SwarmConfig, trainer: list[Event]) -> dict[int, float]:
    """When the trainer finished inner steps, as its records tell: exactly for the steps its stage-0 rounds were
    declared at (logged within 0.25 s); within 2.5 s for a step that two consecutive ``metrics`` records (one every
    ``announce_period_s``, 5 s) show it taking, one before and one after (at real shapes, every step)."""
    declared = [r.time for r in of_kind(trainer, OuterDeclared) if r.stage == 0]
    ends = dict(zip(declared_steps(cfg, len(declared)), declared))
    samples = [(r.time, r.metrics["step"]) for r in of_kind(trainer, Metrics)]
    for (t0, s0), (t1, s1) in zip(samples, samples[1:]):
        if s1 == s0 + 1 and s1 not in ends:
            ends[s1] = (t0 + t1) / 2
    return ends


def swarm_step_times(cfg: SwarmConfig, trainer: list[Event]) -> list[float]:
    """Time per inner step between the trainer's known step ends, spread evenly over the steps between two of them: the
    first step (whose start is the training's, known only within 5 s) left out."""
    ends = step_ends(cfg, trainer)
    known = sorted(ends)
    return [(ends[b] - ends[a]) / (b - a) for a, b in zip(known, known[1:]) for _ in range(b - a)]


def state_bytes(cfg: SwarmConfig, parameters: int) -> int:
    """A stage's state stream, about: the global weights in fp32, and the outer optimizer's momentum buffer where it has
    one (SparseLoCo's error buffers are each replica's own and not in it: ``optim/outer.py``)."""
    momentum = getattr(cfg.outer, f"{cfg.outer.method}_momentum", 0.0)
    return 4 * parameters * (2 if momentum > 0 else 1)


def log_warnings(out: Path) -> dict[str, list[str]]:
    """Each peer's WARNING and ERROR log lines (a failed or timed-out hop, a failed round, ...)."""
    pattern = re.compile(r"\b(WARN|WARNING|ERROR|CRITICAL)\b|Traceback")
    return {
        path.stem: [line for line in path.read_text(errors="replace").splitlines() if pattern.search(line)]
        for path in sorted(out.glob("*.log"))
    }


# ---------------------------------------------------------------- the run


def run_preset(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = bench_config(preset, args)
    steps = steps_for(preset, args)
    params = model_parameters(cfg.model)
    print(
        f"{preset}: {params / 1e6:.1f}M parameters, microbatch {args.microbatch} x {args.seq_len}, {steps} inner steps, "
        f"SparseLoCo H = {args.h}; {StageFootprint.of(cfg, 1).describe()}",
        flush=True,
    )
    result: dict[str, Any] = {"preset": preset, "parameters": params, "steps": steps, "config_hash": cfg.hash()}
    with tempfile.TemporaryDirectory(prefix=f"bench-scale-{preset}-") as tmp:
        out = Path(args.keep) / preset if args.keep else Path(tmp)
        print(f"{preset}: the swarm (peers' logs in {out})", flush=True)
        try:
            result["swarm"] = measure_swarm(cfg, steps, args, out)
        except Exception as e:  # the one-process run and the other presets still run
            result["swarm"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{preset}: the swarm failed: {e}", flush=True)
    print(f"{preset}: one process", flush=True)
    started = time.perf_counter()
    try:
        result["one_process"] = measure_one_process(cfg, steps, args) | {"wall_s": time.perf_counter() - started}
    except Exception as e:
        result["one_process"] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{preset}: the one-process run failed: {e}", flush=True)
    swarm_rate, local_rate = result["swarm"].get("tokens_per_s"), result["one_process"].get("tokens_per_s")
    result["ratio"] = swarm_rate / local_rate if swarm_rate and local_rate else None
    return result


def flops_per_step(cfg: SwarmConfig) -> float:
    """Training FLOPs of an inner step: (6N + 12·layers·d·T) per token, N the parameters but the embedding table's (as
    scripts/gpu_check.py counts them)."""
    m = cfg.model
    n = model_parameters(m) - m.vocab_size * m.d_model
    return (6 * n + 12 * m.n_layers * m.d_model * cfg.train.seq_len) * cfg.train.inner_batch * cfg.train.seq_len


def plan(args: argparse.Namespace) -> list[str]:
    """What the run would do, and a time estimate at ``--gflops`` per process (one thread each): nothing runs."""
    lines, total = [], 0.0
    for preset in args.presets:
        cfg, steps = bench_config(preset, args), steps_for(preset, args)
        step_s = flops_per_step(cfg) / (args.gflops * 1e9)
        # the swarm: its steps (a synchronous pipeline whose servers recompute their forward in the backward: 4/3 of
        # one process' time) and ~70 s to start and stop; one process: its steps and ~15 s of setup
        wall = (steps * step_s * 4 / 3 + 70) + (steps * step_s + 15)
        total += wall
        footprints = " / ".join(
            f"{StageFootprint.of(cfg, stage).total_bytes / 2**20:.0f}" for stage in range(cfg.stages.num_stages + 1)
        )
        lines.append(
            f"{preset}: {model_parameters(cfg.model) / 1e6:.1f}M parameters, {steps} inner steps of "
            f"{cfg.train.inner_batch} x {cfg.train.seq_len} tokens, {flops_per_step(cfg) / 1e12:.2f} TFLOP each "
            f"(≈ {step_s:.0f} s at {args.gflops:g} GFLOP/s); estimate MB stage 0 / 1 / 2: {footprints}, one process "
            f"{StageFootprint.whole_model(cfg).total_bytes / 2**20:.0f}; ≈ {wall / 60:.1f} min for both runs"
        )
    lines.append(
        f"all presets: ≈ {total / 60:.0f} min at {args.gflops:g} GFLOP/s per thread; "
        f"{available_memory(resolve_device(args.device)) / 2**30:.1f} GiB free on {args.device} now (a peer refuses a "
        "stage whose estimate exceeds what is free when it starts; the one-process run only reports it)"
    )
    return lines


def fmt(value: Any, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def table(results: list[dict[str, Any]]) -> list[str]:
    """One column per preset, one row per measure."""
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("parameters", lambda r: f"{r['parameters'] / 1e6:.1f}M"),
        ("inner steps (each microbatch x seq_len)", lambda r: str(r["steps"])),
        ("tokens/s: swarm", lambda r: fmt(r["swarm"].get("tokens_per_s"), ".0f")),
        ("tokens/s: one process", lambda r: fmt(r["one_process"].get("tokens_per_s"), ".0f")),
        ("ratio swarm / one process", lambda r: fmt(r["ratio"])),
        ("s / inner step (median after warm-up): swarm", lambda r: fmt(r["swarm"].get("step_s"))),
        ("s / inner step (median after warm-up): one process", lambda r: fmt(r["one_process"].get("step_s"))),
        ("peak RSS MB: trainer", lambda r: rss(r, TRAINER, "0")),
        ("peak RSS MB: stage 1 server", lambda r: rss(r, "stage1-0", "1")),
        ("peak RSS MB: stage 2 server", lambda r: rss(r, "stage2-0", "2")),
        ("peak RSS MB: joiner (stage 1)", lambda r: rss(r, JOINER, "1")),
        (
            "peak RSS MB: one process (estimate; refused: train-local's check)",
            lambda r: (
                "–"
                if "peak_rss_mb" not in r["one_process"]
                else f"{r['one_process']['peak_rss_mb']:.0f} ({r['one_process']['estimate_mb']:.0f}"
                + (", refused)" if r["one_process"]["refused"] else ")")
            ),
        ),
        ("stage 1 backwards: first server / joiner", lambda r: backwards(r["swarm"])),
        ("stage 1 backwards on a kept graph: first server", lambda r: kept_graphs(r["swarm"])),
        ("stage 1 s / forward: decode/wait/copy/compute/encode", lambda r: time_split(r["swarm"], "forward")),
        ("stage 1 s / backward: decode/wait/copy/compute/encode", lambda r: time_split(r["swarm"], "backward")),
        ("outer round s (2 members, median)", lambda r: fmt(r["swarm"].get("round_s"))),
        ("outer rounds: 2-member / lone round s", lambda r: shared_rounds(r["swarm"])),
        ("state download s (state MB)", lambda r: download(r["swarm"])),
        ("joiner: spawn to serving s", lambda r: fmt(r["swarm"].get("joiner_ready_s"), ".1f")),
        ("bytes/token: activations", lambda r: per_token(r["swarm"], "activations", ".0f")),
        ("bytes/token: activation gradients", lambda r: per_token(r["swarm"], "gradients", ".0f")),
        ("bytes/token: pseudo-gradients", lambda r: per_token(r["swarm"], "pseudo_gradients", ".3f")),
        ("warning/error log lines (all peers)", lambda r: warning_count(r["swarm"])),
    ]
    width = max(len(name) for name, _ in rows)
    cells = [[value(r) for r in results] for _, value in rows]
    col = max([len(r["preset"]) for r in results] + [len(c) for cs in cells for c in cs])
    lines = [f"{'preset':<{width}}  " + "  ".join(f"{r['preset']:>{col}}" for r in results)]
    for (name, _), cs in zip(rows, cells):
        lines.append(f"{name:<{width}}  " + "  ".join(f"{c:>{col}}" for c in cs))
    return lines


def rss(r: dict[str, Any], peer: str, stage: str) -> str:
    swarm = r["swarm"]
    if "peak_rss_mb" not in swarm or peer not in swarm["peak_rss_mb"]:
        return "–"
    return f"{swarm['peak_rss_mb'][peer]:.0f} ({swarm['estimate_mb'][stage]:.0f})"


def shared_rounds(swarm: dict[str, Any]) -> str:
    if "shared_rounds" not in swarm:
        return "–"
    return f"{swarm['shared_rounds']} / {fmt(swarm['round_s_alone'])}"


def backwards(swarm: dict[str, Any]) -> str:
    servers = swarm.get("servers", {})
    return " / ".join(str(servers.get(name, {}).get("backward", "–")) for name in ("stage1-0", JOINER))


def kept_graphs(swarm: dict[str, Any]) -> str:
    server = swarm.get("servers", {}).get("stage1-0", {})
    return fmt(server.get("graph_kept_backward"), "d")


def time_split(swarm: dict[str, Any], kind: str) -> str:
    """The first stage-1 server's median seconds per request of ``kind``, by part (its last progress record's
    ``time_split``: ``swarm/pipeline/timing.py``); "–" where the server has none (a release before issue 34)."""
    split = (swarm.get("servers", {}).get("stage1-0", {}).get("time_split") or {}).get(kind)
    if not split:
        return "–"
    return "/".join(f"{split[part]:.2f}" for part in ("decode_s", "wait_s", "copy_s", "compute_s", "encode_s"))


def download(swarm: dict[str, Any]) -> str:
    if swarm.get("download_s") is None:
        return "–"
    return f"{swarm['download_s']:.2f} ({swarm['state_mb']:.0f})"


def per_token(swarm: dict[str, Any], kind: str, spec: str) -> str:
    return fmt(swarm.get("bytes_per_token", {}).get(kind), spec)


def warning_count(swarm: dict[str, Any]) -> str:
    if "warnings" not in swarm:
        return "–"
    return str(sum(len(lines) for lines in swarm["warnings"].values()))


def parse_steps(values: list[str]) -> dict[str, int]:
    """``--steps 8`` (every preset) or ``--steps 20m=10 125m=6``; the key "" holds the value for every preset."""
    steps = {}
    for value in values:
        preset, _, count = value.rpartition("=")
        steps[preset] = int(count)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["20m", "125m"])
    parser.add_argument(
        "--steps",
        nargs="+",
        default=[],
        help=f"inner steps of each run: N for every preset, or PRESET=N ... (default {STEPS}, else {DEFAULT_STEPS})",
    )
    add_field_arguments(  # SparseLoCo's H and warm start; one microbatch per inner step (preset_config)
        parser,
        SwarmConfig,
        *CONFIG_FIELDS,
        defaults={
            "outer.inner_steps": 2,
            "outer.warm_start_steps": 0,
            "train.seq_len": 1024,
            "train.microbatch_size": 8,
        },
        flags={"outer.inner_steps": ("--h",)},
    )
    parser.add_argument(
        "--join-at-step",
        type=int,
        default=0,
        help="the joiner starts once the trainer trains and has taken this many inner steps (module docstring)",
    )
    # every process's (each peer, one process; the one-process baseline too); keep_graph_mb None: each server's own
    add_field_arguments(parser, PeerConfig, *PEER_FIELDS, defaults={"device": "cpu", "threads": 1})
    parser.add_argument("--set", nargs="*", default=[], metavar="PATH=VALUE", help="more config overrides")
    parser.add_argument("--keep", type=Path, help="keep the swarms' logs and metrics in KEEP/<preset>/")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and a time estimate; run nothing")
    parser.add_argument("--gflops", type=float, default=GFLOPS, help="--dry-run: one thread's training GFLOP/s")
    args = parser.parse_args()
    args.steps, args.set = parse_steps(args.steps), parse_overrides(args.set)
    if args.dry_run:
        print("\n".join(plan(args)))
        return
    load_before = os.getloadavg()
    results = []
    for preset in args.presets:
        started_at = os.getloadavg()
        results.append(run_preset(preset, args) | {"load_start": started_at, "load_end": os.getloadavg()})
        print("\n".join(table(results)), flush=True)
        if args.json:  # after each preset: a later one that fails loses nothing measured
            write_json(args, results, load_before)
    load = os.getloadavg()
    print(
        f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end, "
        f"{load_before[0]:.1f} at the start; {os.cpu_count()} CPUs"
    )
    if args.json:
        print(f"wrote {args.json}")


def write_json(args: argparse.Namespace, results: list[dict[str, Any]], load_start: tuple[float, ...]) -> None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "args": {k: v if isinstance(v, (int, float, str, list, dict)) else str(v) for k, v in vars(args).items()},
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__},
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "table": table(results),
        "results": results,
    }
    args.json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
