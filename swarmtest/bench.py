"""Local swarms for the benchmarks: run one (``swarmloco local``'s peers as processes on loopback) and sum up what its
peers' JSONL records say: loss, throughput, wire bytes per token, outer rounds, busy fractions, a joiner's start.

    summary = run_swarm(bench_config(local_config(base, layout), "sparseloco", 10, "int8"), layout, data, out)
    summary = swarm_summary(read_peers(out), layout)   # the same, from a finished run's folder
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from optim.config import OuterMethod
from peer.launch import LOOPBACK, LocalSwarm, Placement, launch_local
from swarm.config import ConfigValue, SwarmConfig, TrainerOptions, derive_config
from swarm.events import (
    Event,
    OuterRound,
    Progress,
    Serving,
    Spawned,
    StageProgress,
    StateDownload,
    TrainerProgress,
    Training,
    of_kind,
    read_events,
)
from swarm.node.config import PeerConfig

Peers = dict[str, list[Event]]  # each peer's events, by its name


def read_peers(out: Path) -> Peers:
    """Every peer's JSONL records, by peer name (a line still being written is left out)."""
    return {path.stem: read_events(path) for path in sorted(out.glob("*.jsonl"))}


def outer_summary(peers: Peers, tokens: int) -> dict[str, Any]:
    """Outer rounds, their duration and the pseudo-gradient traffic, over every peer."""
    rounds_of = [r for records in peers.values() for r in of_kind(records, OuterRound)]
    done = [r for r in rounds_of if r.outcome == "done"]
    last = [  # final counters: the last progress record (a full peer's sums its stages')
        progress[-1] for records in peers.values() if (progress := of_kind(records, Progress))
    ]
    sent = sum(r.count("pseudo_grad_bytes") for r in last)
    fp32 = sum(r.count("pseudo_grad_fp32_bytes") for r in last)
    rounds: dict[str, int] = {}
    for r in done:
        rounds[str(r.stage)] = max(rounds.get(str(r.stage), 0), r.outer_round)
    return {
        "outer_rounds": rounds,  # per stage: rounds completed
        "round_s": statistics.median(r.round_s for r in done) if done else None,  # declaration to install
        "round_members": statistics.mean(r.contributors for r in done) if done else None,
        "outer_failed_or_late": len(rounds_of) - len(done),
        "state_downloads": sum(len(of_kind(records, StateDownload)) for records in peers.values()),
        "pseudo_grad_bytes_per_token": sent / tokens,
        "fp32_pseudo_grad_bytes_per_token": fp32 / tokens,
        "pseudo_grad_compression_vs_fp32": fp32 / sent if sent else None,
    }


def busy_summary(peers: Peers) -> dict[str, float | None]:
    """Per stage server (by name): the median of its recent busy fraction over the records logged while it served
    (its backward count rose since the previous one), so its wait for the first trainer and its idle tail
    after the last are left out. None for a server that never served."""
    busy: dict[str, float | None] = {}
    for name, records in peers.items():
        stage = of_kind(records, StageProgress)
        if not stage:
            continue
        serving = [
            r.busy_fraction
            for before, r in zip(stage, stage[1:])
            if r.busy_fraction is not None and r.count("backward") > before.count("backward")
        ]
        busy[name] = statistics.median(serving) if serving else stage[-1].busy_fraction_total
    return busy


def recompute_summary(peers: Peers) -> dict[str, float | None]:
    """Over every stage server's backwards: the share differentiated at a stashed copy of the weights their forward ran
    on (inner steps moved them in between), the share recomputed on moved weights (older than the stash keeps), and
    the inner steps between, on average over all."""
    last = [  # each server's last record that counts a backward
        next((r.counters for r in reversed(of_kind(records, StageProgress)) if "backward" in r.counters), {})
        for records in peers.values()
    ]
    backward = sum(r.get("backward", 0) for r in last)
    per_backward = lambda key: sum(r.get(key, 0) for r in last) / backward if backward else None
    return {
        "server_stashed_backward_fraction": per_backward("stashed_backward"),
        "server_stale_recompute_fraction": per_backward("stale_recompute"),
        "server_stale_recompute_steps_mean": per_backward("stale_recompute_steps"),
    }


def window_options(window: int | None, max_staleness: int | None = None) -> TrainerOptions:
    """The trainers' options for a window cap and max staleness; None leaves the trainers' default (a cap of 4,
    staleness 0: the window stays within an inner step)."""
    given = {"in_flight": window, "max_staleness": max_staleness}
    return TrainerOptions(**{name: value for name, value in given.items() if value is not None})


def window_summary(progress: list[TrainerProgress]) -> dict[str, Any]:
    """The trainers' microbatch window over their progress records: its mean size, the mean staleness of the
    microbatches that landed."""
    windows = [r.window for r in progress]
    staleness = [r.staleness_mean for r in progress if r.staleness_mean is not None]
    return {
        "window_mean": statistics.mean(windows) if windows else None,
        "staleness_mean": statistics.mean(staleness) if staleness else None,
    }


def join_summary(records: list[Event]) -> dict[str, Any]:
    """How a late joiner got in: its role, the round it started from, and the time from its start to its first served request."""
    spawned = of_kind(records, Spawned)[0].time
    serving = next(iter(of_kind(records, Serving)), None)
    served = next((r.first_served_at for r in of_kind(records, StageProgress) if r.first_served_at), None)
    return {
        "join_role": "stage" if serving else "trainer",
        "join_stage": serving and serving.stage,
        "join_round": serving and serving.outer_round,
        "join_ready_s": serving and serving.time - spawned,
        "join_s": served and served - spawned,
    }


def run_swarm(
    cfg: SwarmConfig,
    layout: LocalSwarm,
    data: list[str] | None,
    out: Path,
    place: Callable[[str], Placement] = lambda name: LOOPBACK,
    trainer: TrainerOptions | None = None,
    peer: PeerConfig | None = None,
) -> dict[str, Any]:
    """Run the swarm to the end; its loss, throughput and traffic from the peers' metrics (``place``: see ``launch_local``;
    ``trainer``: the trainers' options, e.g. ``window_options``; ``peer``: the options every peer shares, e.g.
    ``--pace-as``, its data and trainer options then set from ``data`` and ``trainer``)."""
    started = time.perf_counter()
    peer = dataclasses.replace(peer or PeerConfig(), data=list(data or ()), trainer=trainer or TrainerOptions())
    code = launch_local(layout, out=out, config=cfg, peer=peer, place=place, export=False)
    if code != 0:
        raise SystemExit(f"the swarm failed (exit {code}); logs in {out}")
    peers = read_peers(out)
    wall_s = time.perf_counter() - started  # startup and shutdown of every process included
    joiners = [name for name in peers if name.startswith("joiner-")]
    return swarm_summary(peers, layout) | {"wall_s": wall_s} | (join_summary(peers[joiners[0]]) if joiners else {})


def swarm_summary(peers: Peers, layout: LocalSwarm) -> dict[str, Any]:
    """A finished swarm's loss, throughput and traffic from its peers' records. Every replica that trains (trainers,
    then full peers) counts for tokens; the pipeline's counters are the trainers' (a full peer sends no activations)."""
    names = [f"trainer-{i}" for i in range(layout.trainers)] + [f"full-{i}" for i in range(layout.full)]
    last = {name: of_kind(peers[name], Training)[-1] for name in names}
    replicas = list(last.values())
    trainers = [r for name in names[: layout.trainers] if isinstance(r := last[name], TrainerProgress)]
    tokens = sum(r.tokens for r in replicas)
    training = ("activations", "gradients")  # validation traffic is counted apart ("eval"), not per training token
    wire = {kind: sum(t.wire_bytes[kind] for t in trainers) for kind in training}
    fp32 = {kind: sum(t.fp32_bytes[kind] for t in trainers) for kind in training}
    return {
        "val_loss": replicas[0].val_loss,  # trainer-0's (through the swarm's current replicas), else full-0's
        "val_losses": {name: r.val_loss for name, r in last.items()},
        "tokens": tokens,
        "tokens_per_s": sum(r.tokens_per_s for r in replicas),  # while training, startup excluded
        "bytes_per_token": {kind: wire[kind] / tokens for kind in training} | {"total": sum(wire.values()) / tokens},
        "fp32_bytes_per_token": {kind: fp32[kind] / tokens for kind in training}
        | {"total": sum(fp32.values()) / tokens},
        "failed_hops": sum(t.pipeline.hop_failures + t.pipeline.hop_timeouts + t.refused_hops() for t in trainers),
        "skipped_hops": sum(t.pipeline.skipped_hops for t in trainers),
        "resent_inputs": sum(t.pipeline.resent_inputs for t in trainers),
        "microbatches": {
            k: sum(getattr(t.pipeline, k) for t in trainers) for k in ("started", "completed", "failed", "cancelled")
        },
        "unaccounted_microbatches": sum(t.pipeline.in_flight for t in trainers),
        **outer_summary(peers, tokens),
        "busy_fraction": busy_summary(peers),  # per stage server: median while serving
        **recompute_summary(peers),
        **window_summary([r for i in range(layout.trainers) for r in of_kind(peers[f"trainer-{i}"], TrainerProgress)]),
    }


def bench_config(
    base: SwarmConfig,
    outer: OuterMethod | None,
    inner_steps: int | None,
    codec: str | None,
    extra: Mapping[str, ConfigValue] | None = None,
) -> SwarmConfig:
    """The config with the outer method (DiLoCo exchanges fp32), H, the activation/gradient codec and the ``extra``
    dotted-path overrides (``--set``) changed where given."""
    overrides: dict[str, ConfigValue] = {"codecs.pseudo_gradients": "fp32"} if outer == "diloco" else {}
    if inner_steps:
        overrides["outer.inner_steps"] = inner_steps
    if codec:
        overrides["codecs.activations"] = codec
    return derive_config(base, overrides | dict(extra or {}), outer=outer)


def preset_config(
    preset: str,
    *,
    seq_len: int,
    microbatch: int,
    precision: str = "fp32",
    extra: Mapping[str, ConfigValue] | None = None,
) -> SwarmConfig:
    """The real-shape benchmarks' config: ``preset`` in 2 middle stages, ``microbatch`` samples of ``seq_len`` tokens
    per microbatch and one microbatch per inner step, in ``precision``; ``extra`` dotted-path overrides on top."""
    shapes: dict[str, ConfigValue] = {
        "model.preset": preset,
        "stages.num_stages": 2,
        "train.seq_len": seq_len,
        "train.microbatch_size": microbatch,
        "train.inner_batch": microbatch,  # one microbatch per inner step
        "train.precision": precision,
    }
    return derive_config(SwarmConfig(), shapes | dict(extra or {}))
