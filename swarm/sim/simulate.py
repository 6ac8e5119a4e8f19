"""An in-process, deterministic swarm: the algorithms without the network.

K replicas of every stage (stage 0: K trainers) train with the swarm's step, codecs and outer optimizers
(``mode="ddp"``: fp32 gradient averaging instead), counting the bytes that would cross the network by kind.
More: docs/architecture.md, sim/.

    >>> simulate(cfg, SimulationConfig(replicas=2, tokens=200_000), streams, val_batches).bytes_per_token["total"]
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import torch
from torch import nn

from optim.factory import build_outer_optimizer
from optim.noloco import NoLoCo, partners
from optim.outer import OuterOptimizer
from swarm.cli_fields import cli
from swarm.config import SwarmConfig
from swarm.errors import ConfigError
from swarm.hardware import CPU, Precision, compute_precision
from swarm.model.compiling import COMPILE_HELP, COMPILE_MODES, CompileMode, compile_stage
from swarm.model.stages import EDGE_STAGE, EdgeStage, MiddleStage, build_stage, run_path
from swarm.model.step import InnerStep, run_microbatch
from swarm.pipeline.boundary import Link, boundary_codecs, fp32_boundaries, full_replica_link
from swarm.pipeline.routing import sample_path
from swarm.sim.centralized import Batch, evaluate

MODES = ("ddp", "outer")
Routing = Literal["random", "sticky"]  # random: SWARM, any replica per hop; sticky: trainer k always uses replica k
ROUTINGS: tuple[Routing, ...] = get_args(Routing)
BYTE_KINDS = ("activations", "activation_gradients", "pseudo_gradients", "gradients")


@dataclass(kw_only=True)
class SimulationConfig:
    """One simulation's own settings (the swarm's are its ``SwarmConfig``); each field with ``cli`` metadata is a
    ``swarmloco simulate`` option."""

    replicas: int = field(default=2, metadata=cli("Replicas per stage (and trainers): K.", aliases=("-k",), min=1))
    mode: str = "outer"  # outer: DiLoCo/SparseLoCo per the swarm config; ddp: fp32 gradient all-reduce every tick
    routing: Routing = field(
        default="random",
        metadata=cli(
            "random: any replica per hop (SWARM); sticky: trainer k always uses replica k (DiLoCo's pipelines)."
        ),
    )
    tokens: int = field(default=500_000, metadata=cli("Training tokens over all trainers.", min=1))
    seed: int = field(default=0, metadata=cli("Seed of the initial weights and of the routing."))
    log_every: int = field(default=25, metadata=cli("Log every N ticks (one microbatch per trainer).", min=1))
    # replicas 0..full-1 are full peers (``swarm/node/roles/full.py``): trainer k runs the whole model on its own
    # copies k of every stage, every stage in order, with no wire between them; the others are pipelined among themselves
    # (their own boundaries are coded as the swarm config's ``codecs.full_boundaries`` says)
    full: int = field(
        default=0,
        metadata=cli(
            "Replicas 0..N-1 are full peers: each trains the whole model on its own copies, no wire between its "
            "stages; the other replicas are pipelined among themselves.",
            min=0,
        ),
    )
    # count boundary bytes after zstd, which runs on the host; off, frames stay on the device and are counted before
    # zstd (training is the same): what lets ``--device cuda`` run near train-local's speed at 125m
    wire_zstd: bool = field(
        default=True,
        metadata=cli(
            "Count boundary bytes after zstd, as the wire sends them (zstd runs on the host); --no-wire-zstd keeps "
            "every frame on the device and counts its bytes before zstd: training is the same, and a GPU runs faster."
        ),
    )
    compile: CompileMode = field(default="auto", metadata=cli(COMPILE_HELP))  # every replica's blocks

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError("replicas", f"must be at least 1, got {self.replicas}")
        if self.mode not in MODES:
            raise ConfigError("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.routing not in ROUTINGS:
            raise ConfigError("routing", f"must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.tokens <= 0 or self.log_every <= 0:
            raise ConfigError("tokens", "tokens and log_every must be positive")
        if not 0 <= self.full <= self.replicas:
            raise ConfigError("full", f"must be in [0, replicas={self.replicas}], got {self.full}")
        if self.compile not in COMPILE_MODES:
            raise ConfigError("compile", f"must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")


@dataclass
class Replica:
    """One copy of one stage with its own inner optimizer (and outer optimizer, if any)."""

    module: EdgeStage | MiddleStage
    inner: InnerStep  # its AdamW, and the samples served since its last inner step
    outer: OuterOptimizer[Any] | None

    @property
    def params(self) -> dict[str, nn.Parameter]:
        return dict(self.module.named_parameters())

    @property
    def edge(self) -> EdgeStage:
        """The module of a replica of stage 0."""
        if not isinstance(self.module, EdgeStage):
            raise TypeError(f"a replica of a middle stage holds no edge stage: {type(self.module).__name__}")
        return self.module

    @property
    def middle(self) -> MiddleStage:
        """The module of a replica of a middle stage."""
        if not isinstance(self.module, MiddleStage):
            raise TypeError(f"a replica of stage 0 holds no middle stage: {type(self.module).__name__}")
        return self.module

    @property
    def outer_step(self) -> OuterOptimizer[Any]:
        """Its outer optimizer, in a simulation that has one."""
        if self.outer is None:
            raise TypeError("this simulation has no outer step")
        return self.outer


@dataclass
class SimulationResult:
    val_loss: float
    tokens: int
    ticks: int
    outer_rounds: int
    wall_s: float
    bytes_by_kind: dict[str, int]
    messages_by_kind: dict[str, int]  # activation frames sent, by kind
    skipped_stage_visits: int  # hops left out by skip paths, summed over microbatches
    log: list[dict[str, float]] = field(default_factory=list)
    replicas: dict[int, list[Replica]] = field(default_factory=dict, repr=False)  # final state, by stage

    @property
    def bytes_per_token(self) -> dict[str, float]:
        per = {kind: self.bytes_by_kind.get(kind, 0) / self.tokens for kind in BYTE_KINDS}
        return per | {"total": sum(per.values())}


def make_replica(
    cfg: SwarmConfig,
    stage: int,
    total_steps: int,
    with_outer: bool,
    device: torch.device = CPU,
    compile_mode: CompileMode = "off",
) -> Replica:
    module = build_stage(cfg.model, cfg.stages.num_stages, stage).to(device)
    compile_stage(module, compile_mode, device)  # in place: names, state dicts and the outer step see the same module
    inner = InnerStep(
        module.parameters(), replace(cfg.inner, total_steps=total_steps), inner_batch=cfg.train.inner_batch
    )
    outer = build_outer_optimizer(dict(module.named_parameters()), cfg.outer, cfg.codecs) if with_outer else None
    return Replica(module, inner, outer)


def train_microbatch(
    trainer: Replica,
    hops: list[Replica],
    batch: Batch,
    link: Link,
    *,
    step_when_due: bool = True,
    precision: Precision = "fp32",
) -> float:
    """One microbatch along ``hops`` and back through the link's codecs, as in the swarm: gradients accumulate,
    and each replica takes its inner step once it has served an inner batch (unless ``step_when_due`` is off: DDP)."""
    edge, middles = trainer.edge, [r.middle for r in hops]
    inputs, targets = (t.to(link.device) for t in batch)
    with compute_precision(link.device, precision):
        loss = run_microbatch(edge, middles, (inputs, targets), inner_batch=trainer.inner.inner_batch, send=link.send)
    for replica in [trainer, *hops]:
        replica.inner.add(batch[0].shape[0], step_when_due=step_when_due)
    return loss


def ddp_step(group: list[Replica]) -> int:
    """Average gradients over the whole group (weighted by samples), everyone steps; returns fp32 bytes moved."""
    served = sum(r.inner.samples for r in group)
    if served == 0:
        return 0
    # each microbatch's gradient carries the weight samples / inner_batch (swarm/model/step.py): the group's
    # mean gradient is their sum times inner_batch / served, as if the samples served were one inner batch
    scale = group[0].inner.inner_batch / served
    params = [list(r.module.parameters()) for r in group]
    for column in zip(*params):
        total = sum((p.grad if p.grad is not None else torch.zeros_like(p) for p in column), torch.zeros(())) * scale
        for p in column:
            p.grad = total.clone()
    for r in group:
        r.inner.step()
    k, size = len(group), sum(p.numel() * 4 for p in params[0])
    return int(k * size * 2 * (k - 1) / k)  # ring all-reduce: each member sends 2(K−1)/K of the buffer


def outer_round(group: list[Replica]) -> int:
    """One outer step of a stage's replicas via an in-process all-gather; returns bytes moved."""
    if len(group) == 1:  # nobody to agree with: nothing is sent, nothing lost
        group[0].outer_step.apply_alone(group[0].params)
        return 0
    payloads = [r.outer_step.make_payload(r.params) for r in group]
    for r in group:
        r.outer_step.apply(payloads, r.params)
    if isinstance(group[0].outer, NoLoCo):  # each payload reaches its partner(s) only
        return sum(len(payloads[i]) * (len(pair) - 1) for pair in partners(len(group), 0) for i in pair)
    return sum(len(p) for p in payloads) * (len(group) - 1)  # all-gather: each payload reaches K−1 members


def build_replicas(
    cfg: SwarmConfig,
    k: int,
    *,
    total_steps: int,
    with_outer: bool,
    device: torch.device,
    wire_zstd: bool = True,
    compile_mode: CompileMode = "off",
) -> tuple[dict[int, list[Replica]], Link, Link]:
    """``k`` replicas of every stage (their blocks compiled as ``compile_mode`` says); the link of pipelined hops (its
    bytes are counted, after zstd if ``wire_zstd``) and the full peers' own."""
    stages = range(cfg.stages.num_stages + 1)
    replicas = {
        s: [make_replica(cfg, s, total_steps, with_outer, device, compile_mode) for _ in range(k)] for s in stages
    }
    link = Link(*boundary_codecs(cfg), device=device, zstd=wire_zstd)
    # a full replica's boundaries are in its own memory: no bytes cross a wire (its link's bytes are not counted)
    full_link = full_replica_link(cfg, device, zstd=False) or Link(
        *boundary_codecs(fp32_boundaries(cfg)), device=device, zstd=False
    )
    return replicas, link, full_link


def train_tick(
    cfg: SwarmConfig,
    sim: SimulationConfig,
    replicas: dict[int, list[Replica]],
    streams: list[Iterator[Batch]],
    rng: random.Random,
    *,
    link: Link,
    full_link: Link,
) -> tuple[list[float], int]:
    """Each trainer's microbatch of one tick, in trainer order: a full peer's through its own copy of every stage, in
    order, over ``full_link``; a pipelined one's along a drawn path, a replica per hop. (losses, stage visits skipped)"""
    S, losses, skipped = cfg.stages.num_stages, [], 0
    pipelined = list(range(sim.full, sim.replicas))  # the replicas a pipelined trainer's hops choose among
    for k, (trainer, stream) in enumerate(zip(replicas[EDGE_STAGE], streams)):
        if k < sim.full:  # a full peer: its own copy of every stage, in order
            path, hops = list(range(1, S + 1)), [replicas[s][k] for s in range(1, S + 1)]
        else:
            path = sample_path(S, cfg.paths, rng)
            hops = [replicas[s][k] if sim.routing == "sticky" else replicas[s][rng.choice(pipelined)] for s in path]
        skipped += S - len(path)
        losses.append(
            train_microbatch(
                trainer,
                hops,
                next(stream),
                full_link if k < sim.full else link,
                step_when_due=sim.mode == "outer",
                precision=cfg.train.precision,
            )
        )
    return losses, skipped


def simulate(
    cfg: SwarmConfig,
    sim: SimulationConfig,
    streams: list[Iterator[Batch]],
    val_batches: list[Batch],
    on_log: Callable[[dict[str, float]], None] = lambda record: None,
    device: torch.device = CPU,
) -> SimulationResult:
    """Run the swarm for ``sim.tokens`` training tokens on ``device``; ``streams`` holds one batch iterator per trainer."""
    if len(streams) != sim.replicas:
        raise ValueError(f"need one data stream per trainer: {sim.replicas}, got {len(streams)}")
    torch.manual_seed(sim.seed)
    rng = random.Random(sim.seed)
    S, K = cfg.stages.num_stages, sim.replicas
    tokens_per_tick = K * cfg.train.microbatch_size * cfg.train.seq_len
    ticks = max(1, sim.tokens // tokens_per_tick)
    # H and the lr schedule count inner steps, as in the swarm: one per inner_batch samples a replica serves
    ticks_per_step = cfg.train.inner_batch // cfg.train.microbatch_size
    next_round_tick = cfg.outer.horizon(0) * ticks_per_step  # H counts inner steps (a warm start's are 1)
    with_outer, steps = sim.mode == "outer" and cfg.outer.method != "none", max(1, ticks // ticks_per_step)
    replicas, link, full_link = build_replicas(
        cfg,
        K,
        total_steps=steps,
        with_outer=with_outer,
        device=device,
        wire_zstd=sim.wire_zstd,
        compile_mode=sim.compile,
    )
    skipped = outer_rounds = 0
    log: list[dict[str, float]] = []
    started = time.perf_counter()
    for tick in range(1, ticks + 1):
        losses, skipped_now = train_tick(cfg, sim, replicas, streams, rng, link=link, full_link=full_link)
        skipped += skipped_now
        if sim.mode == "ddp" and tick % ticks_per_step == 0:
            agree(replicas, link, ddp=True)
        elif with_outer and (tick >= next_round_tick or tick == ticks):
            agree(replicas, link, ddp=False)
            outer_rounds += 1
            next_round_tick = tick + cfg.outer.horizon(tick // ticks_per_step) * ticks_per_step
        if tick % sim.log_every == 0 or tick == ticks:
            record = tick_record(tick, tick * tokens_per_tick, losses, replicas, S, val_batches, link, started, device)
            log.append(record)
            on_log(record)
    return SimulationResult(
        val_loss=log[-1]["val_loss"],
        tokens=ticks * tokens_per_tick,
        ticks=ticks,
        outer_rounds=outer_rounds,
        wall_s=time.perf_counter() - started,
        bytes_by_kind=dict(link.bytes),
        messages_by_kind=dict(link.messages),
        skipped_stage_visits=skipped,
        log=log,
        replicas=replicas,
    )


def agree(replicas: dict[int, list[Replica]], link: Link, *, ddp: bool) -> None:
    """Every stage's replicas agree once, the bytes that moves counted on ``link``: with ``ddp`` they average their
    gradients and each takes its inner step (``ddp_step``), otherwise they take an outer step (``outer_round``)."""
    for group in replicas.values():
        if ddp:
            link.bytes["gradients"] += ddp_step(group)
        else:
            link.bytes["pseudo_gradients"] += outer_round(group)


def tick_record(
    tick: int,
    tokens: int,
    losses: list[float],
    replicas: dict[int, list[Replica]],
    num_stages: int,
    val_batches: list[Batch],
    link: Link,
    started: float,
    device: torch.device,
) -> dict[str, float]:
    """The log's record after ``tick`` (``tokens`` trained so far): the tick's mean training loss, replica 0's
    validation loss through the full pipeline, seconds since ``started`` and the bytes per token sent so far."""
    return {
        "tick": tick,
        "tokens": tokens,
        "train_loss": sum(losses) / len(losses),
        "val_loss": full_pipeline_loss(replicas, num_stages, val_batches, device=device),
        "elapsed_s": time.perf_counter() - started,
        "bytes_per_token": sum(link.bytes.values()) / tokens,
    }


def full_pipeline_loss(
    replicas: dict[int, list[Replica]], num_stages: int, val_batches: list[Batch], *, device: torch.device = CPU
) -> float:
    """Validation loss of replica 0 of every stage through the full path 1..S, no codec, no skips."""
    edge = replicas[EDGE_STAGE][0].edge
    middles = {s: replicas[s][0].middle for s in range(1, num_stages + 1)}
    modules = [edge, *middles.values()]
    for m in modules:
        m.eval()
    loss = evaluate(lambda x: run_path(edge, middles, list(range(1, num_stages + 1)), x), val_batches, device=device)
    for m in modules:
        m.train()
    return loss
