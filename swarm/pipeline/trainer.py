"""The trainer loop: data → stage 0 → a sampled path of stage servers → loss → backward along the same hops.

``Trainer`` holds the edge stage (labels never leave it) and keeps a transport ``Window`` (window.py) of microbatches
in flight across inner steps, within ``max_staleness``; ``RemoteStages`` (hops.py) carries each one's frames along its
hops (a replica per hop, a codec per link from ``LinkCodecs``, retries, resent inputs, audits of the servers' work).
The math is ``swarm/model/step.py``'s. Window, staleness and drops: docs/architecture.md, pipeline/.

    >>> await Trainer(cfg, StageClient(p2p, namespace=cfg.swarm_id), router).train(batches, steps=100, on_log=print)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import torch

from swarm.config import SwarmConfig, TrainerOptions
from swarm.dht.metrics import Traffic
from swarm.dht.records import StageStatus, verdicts
from swarm.events import PipelineCounts, TrainerProgress
from swarm.events.progress import training_fields
from swarm.hardware import CPU
from swarm.model.stages import EDGE_STAGE, EdgeStage, build_stage
from swarm.model.step import Gradients, InnerStep, WeightChange
from swarm.pipeline.boundary import boundary_ladders
from swarm.pipeline.edge import EdgeCompute, PacedEdge
from swarm.pipeline.frames import LinkCodecs, Microbatch, Outgoing
from swarm.pipeline.hops import HopFailed, RemoteStages, StageCalls
from swarm.pipeline.pacing import Pace
from swarm.pipeline.relaying import RelayedHops
from swarm.pipeline.routing import Peer, Router, path_length
from swarm.pipeline.window import Departure, Window

logger = logging.getLogger(__name__)
Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), (B, T) int64 each
T = TypeVar("T")
# microbatches: started = completed + failed + cancelled (on shutdown) + in flight; of the completed, those whose
# stage-0 gradients were dropped: landed more than max_staleness inner steps after their start, or began before a
# download replaced the weights (with those landed since the last inner step; the name is older); hops: failed
# attempts (retried elsewhere), timeouts (deadlines missed), stages skipped on the way forward, inputs resent for a
# backward; bans for deadlines missed in a row; checked forwards (checking.py, audit.py): checks done, disagreements
# (outputs apart, judged by their loss), servers condemned (their backwards failed probes), disagreements no loss
# could settle, outputs that failed their loss judgement, outputs worse than the other's yet better than skipping the
# stage, servers found unfit (outputs worse than no work: routed around until they sync); probed backwards
# (probing.py): probes judged, probes failed, probes whose step the replies' rounding swallowed, probes not answered
# (refused: the weights gone; or no reply)
COUNTERS = (
    "started",
    "completed",
    "failed",
    "cancelled",
    "stale_dropped",
    "round_dropped",
    "hop_failures",
    "hop_timeouts",
    "skipped_hops",
    "resent_inputs",
    "deadline_bans",
    "checks",
    "check_disagreements",
    "check_strikes",
    "checks_unresolved",
    "check_failures",
    "checks_behind",
    "check_rests",
    "probes",
    "probe_failures",
    "probes_unresolved",
    "probes_unanswered",
)


class Trainer:
    """Stage 0 (embedding, head, loss) and its inner step, keeping a window of microbatches going through the
    middle stages (``RemoteStages``) and landing each one's gradients.

    ``pace``: a benchmark's paced trainer (``swarm/pipeline/pacing.py``): its embedding and head wait the reference
    device's time and give recorded tensors, its weights never move, and it checks and probes no server's work (their
    outputs are replayed: every check would fail) and runs no validation pass (every loss is the recording's).
    """

    def __init__(
        self,
        cfg: SwarmConfig,
        calls: StageCalls,
        router: Router,
        *,
        options: TrainerOptions | None = None,
        start_step: int = 0,
        traffic: Traffic | None = None,
        device: torch.device = CPU,
        pace: Pace | None = None,
    ) -> None:
        self.cfg, self.router, self.pace = cfg, router, pace
        self.options = options or TrainerOptions()
        if pace is not None:
            self.options = replace(self.options, check_rate=0.0, probe_rate=0.0)
            logger.info(f"{pace.describe()}; checks and probes off, no validation pass")
        self.device = device  # the edge stage's; token batches and decoded frames are moved here
        self.edge = build_stage(cfg.model, cfg.stages.num_stages, EDGE_STAGE).to(device)
        assert isinstance(self.edge, EdgeStage)
        kind = EdgeCompute if pace is None else functools.partial(PacedEdge, pace=pace)
        self.compute = kind(self.edge, device=device, precision=cfg.train.precision, inner_batch=cfg.train.inner_batch)
        self.inner = InnerStep(
            self.edge.parameters(), cfg.inner, inner_batch=cfg.train.inner_batch, start_step=start_step
        )
        self.start_step = start_step  # a trainer that joins mid-run starts at the swarm's point of the lr schedule
        activations, gradients = boundary_ladders(cfg)
        self.codecs = LinkCodecs({"activations": activations, "gradients": gradients})
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))  # (+ hop_refused_<code> when servers refuse)
        self.traffic = traffic or Traffic()  # frame bytes by kind and direction: the peer's metrics publish it
        self.fp32_bytes: Counter[str] = Counter()  # what the same tensors cost as raw fp32
        self.remote = RemoteStages(
            cfg,
            calls,
            router,
            self.options,
            codecs=self.codecs,
            counters=self.counters,
            traffic=self.traffic,
            fp32_bytes=self.fp32_bytes,
            device=device,
            loss_of=self._loss_of,
            encode=None if pace is None else pace.encode,
        )
        self.relayed = RelayedHops(self.remote, calls) if self.options.relay else None  # type: ignore[arg-type]
        if self.relayed is not None and not hasattr(calls, "fetch"):
            raise ValueError("--relay needs stage calls that fetch relayed frames (a RelayClient)")
        # tokens of the training microbatches whose stage-0 gradients were taken on landing and not dropped since by
        # a download (``_drop_held_gradients``): counted on the edge thread, with the gradients
        self.tokens = 0
        self.window = Window(self.options.in_flight)
        self.staleness: list[int] = []  # of the microbatches landed since the last progress record
        self._weights_epoch = 0  # weights replaced from outside (a download)
        self._landed_since_step = 0  # microbatches whose gradients stage 0 holds, not yet stepped
        self._held_tokens = 0  # their tokens
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge")

    async def train(
        self,
        batches: Iterator[Batch],
        *,
        steps: int,
        val_batches: Sequence[Batch] = (),
        on_log: Callable[[dict[str, Any]], None] = lambda record: None,
    ) -> dict[str, Any]:
        """Run until ``steps`` inner steps of stage 0; returns the last progress record."""
        started, logged, failures_in_a_row = time.perf_counter(), self.inner_steps, 0
        losses: list[float] = []
        record = self.progress(started, losses)
        tasks: set[asyncio.Task[float | None]] = set()
        if self.pace is not None:
            val_batches = ()  # a paced run's loss is the recording's
        try:
            while self.inner_steps < steps:
                while len(tasks) < self.window.size and self._may_start(len(tasks), steps):
                    tasks.add(asyncio.create_task(self.train_microbatch(*next(batches))))
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if (loss := task.result()) is None:
                        failures_in_a_row += 1
                    else:
                        failures_in_a_row = 0
                        losses.append(loss)
                if failures_in_a_row >= self.options.max_failures_in_a_row:
                    raise RuntimeError(
                        f"{failures_in_a_row} microbatches failed in a row (see the warnings above); stopping"
                    )
                if self.inner_steps >= min(logged + self.options.log_every, steps):
                    logged = self.inner_steps
                    record = self.progress(started, losses)
                    every = self.options.eval_every
                    if val_batches and (self.inner_steps >= steps or (every and self.inner_steps % every == 0)):
                        record["val_loss"] = await self.evaluate(val_batches)
                    on_log(record)
                    losses = []
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.remote.close()
        return record

    def _may_start(self, in_flight: int, steps: int) -> bool:
        """Whether one more microbatch may start now: landing after those in flight, in order, it would join an inner
        step at most ``max_staleness`` after the current one (0: only the current step's, the synchronous pipeline),
        and no later than the last step of the run."""
        ib = self.cfg.train.inner_batch
        planned = self.inner_steps * ib + self.inner.samples + in_flight * self.cfg.train.microbatch_size
        return planned < min(self.inner_steps + 1 + self.options.max_staleness, steps) * ib

    def progress(self, started: float, losses: list[float]) -> dict[str, Any]:
        """The progress record (``TrainerProgress``, as its JSON line: ``train`` adds ``val_loss`` and the role the
        outer step's part); staleness (inner steps between a microbatch's start and its landing, the dropped
        included) over the microbatches landed since the last record."""
        elapsed = time.perf_counter() - started
        staleness, self.staleness = self.staleness, []
        counters = dict(self.counters)
        pipeline = PipelineCounts(**{name: counters.pop(name) for name in COUNTERS})  # the rest: hop_refused_<code>
        return TrainerProgress(
            **training_fields(
                step=self.inner_steps,
                tokens=self.tokens,
                elapsed_s=elapsed,
                losses=losses,
                lr=self.inner.lr,
                grad_norm=self.inner.grad_norm,
            ),
            window=self.window.size,
            round_trip_s=self.window.round_trip_s,
            microbatches_per_s=self.window.microbatches_per_s,
            staleness_mean=sum(staleness) / len(staleness) if staleness else None,
            staleness_max=max(staleness, default=None),
            pipeline=pipeline,
            counters=counters,
            wire_bytes=dict(self.traffic.sent + self.traffic.received),
            fp32_bytes=dict(self.fp32_bytes),
            frames_sent=dict(self.traffic.frames),  # by codec
            links=self.codecs.report(),  # per peer: codecs chosen, bytes/s and compute per call measured
            condemned=tuple(sorted(map(str, self.condemned))),  # servers whose work contradicted itself, banned now
        ).to_record()

    def status(self) -> StageStatus:
        in_flight = self.counters["started"] - sum(self.counters[k] for k in ("completed", "failed", "cancelled"))
        # the servers it condemned: their stages' replicas leave their pseudo-gradients out of the round
        condemned = verdicts(self.remote.audit.checker.condemned, now=time.monotonic(), dht_now=time.time())
        grad_norm = float(self.inner.grad_norm)
        return StageStatus(queue=in_flight, inner_steps=self.inner_steps, grad_norm=grad_norm, condemned=condemned)

    async def train_microbatch(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """One microbatch through the swarm and back; its loss, or None if it failed (counted)."""
        mb_id, shape, inputs = (
            self.remote.new_id(),
            (*inputs.shape, self.cfg.model.d_model),
            self.compute.inputs(inputs),
        )
        self.counters["started"] += 1
        try:
            path = self.router.draw_path(self.cfg.paths)
            mb = Microbatch(mb_id, shape, train=True, path=tuple(path), targets=targets)
            self.counters["skipped_hops"] += path_length(self.cfg.stages.num_stages, self.cfg.paths) - len(path)
            # the steps of swarm/model/step.py, with an RPC per middle-stage hop
            h0, departure = await self._run(self._embed, inputs)  # (B, T, d), holds the embedding's graph
            if self.relayed is not None:  # frames server to server (relaying.py)
                relayed, h = await self.relayed.forward_path(mb, path, h0.detach(), inputs)
                hops = [r.hop for r in relayed]
            else:
                hops, h = await self.remote.forward_path(mb, path, h0.detach(), inputs)
            loss, grad, head_grads = await self._run(self.compute.head_gradients, h, targets)
            self.remote.audit.observe_loss(loss, [hop.peer for hop in hops])  # spikes make a path's servers suspect
            outgoing = Outgoing(grad, None, encode=self.remote.encode)
            if self.relayed is not None:
                outgoing = await self.relayed.backward_path(mb, relayed, outgoing)
            else:
                outgoing = await self.remote.backward_path(mb, hops, outgoing)
            grad = outgoing.value
            staleness = await self._run(self._land, departure, h0, grad, head_grads)
        except asyncio.CancelledError:
            self.counters["cancelled"] += 1
            raise
        except Exception as e:  # HopFailed, or a bug: either way counted and said, never silent
            self.counters["failed"] += 1
            logger.warning(f"microbatch {mb_id} failed: {e}", exc_info=not isinstance(e, HopFailed))
            return None
        self.counters["completed"] += 1
        self.staleness.append(staleness)
        self.window.land(departure.delivered, departure.at, now=time.perf_counter())
        return loss

    async def evaluate(self, batches: Sequence[Batch]) -> float:
        """Mean validation loss over the full plain path 1..S (stages with no live replica skipped)."""
        total, count = 0.0, 0
        size = self.cfg.train.microbatch_size  # the most a server accepts
        for inputs, targets in ((x, y) for batch in batches for x, y in zip(*(torch.split(t, size) for t in batch))):
            # its path and targets: every one of its forwards is checked before it counts (``HopAudit.forward``)
            path = sorted(self.router.live_stages())
            shape = (*inputs.shape, self.cfg.model.d_model)
            mb = Microbatch(self.remote.new_id(), shape, train=False, path=tuple(path), targets=targets)
            h0 = await self._run(self.compute.embed_eval, inputs)
            _, h = await self.remote.forward_path(mb, path, h0, inputs)
            total += await self._run(self.compute.head_eval, h, targets) * inputs.shape[0]
            count += inputs.shape[0]
        return total / count

    async def _loss_of(self, mb: Microbatch, h: torch.Tensor) -> float:
        """The loss of a microbatch's last boundary output ``h`` (a check's judge: ``HopAudit``)."""
        assert mb.targets is not None
        return await self._run(self.compute.head_eval, h, mb.targets)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # torch work, on the single edge thread (serialised with the inner step)

    def _embed(self, inputs: torch.Tensor) -> tuple[torch.Tensor, Departure]:
        # stamped here, on the edge thread: with the weights epoch and inner step the embedding ran at
        departure = Departure(
            inner_steps=self.inner_steps,
            weights=self._weights_epoch,
            at=time.perf_counter(),
            delivered=self.window.delivered,
        )
        return self.compute.embed(inputs), departure

    def _land(self, departure: Departure, h0: torch.Tensor, grad: torch.Tensor, head_grads: Gradients) -> int:
        """A microbatch's stage-0 gradients (and its tokens) join the inner step (step 3's held part, 5 and 6), unless
        it landed more than ``max_staleness`` steps after its start or began on weights a download has since
        replaced (dropped and counted). Its staleness."""
        staleness = self.inner_steps - departure.inner_steps
        if departure.weights != self._weights_epoch:
            self.counters["round_dropped"] += 1
            return staleness
        if staleness > self.options.max_staleness:
            self.counters["stale_dropped"] += 1
            return staleness
        self.compute.backward(h0, grad, head_grads)
        tokens = h0.shape[0] * h0.shape[1]  # (B, T, d)
        self._landed_since_step += 1
        self._held_tokens += tokens
        self.tokens += tokens
        self.inner.add(h0.shape[0])
        if self.inner.samples == 0:  # stepped (or skipped a non-finite step): nothing held any more
            self._landed_since_step = self._held_tokens = 0
        return staleness

    def _drop_held_gradients(self) -> None:
        """Weights replaced from outside: the gradients held for the next inner step were computed on the old ones."""
        self.counters["round_dropped"] += self._landed_since_step
        self.tokens -= self._held_tokens  # trained nothing: the run's tokens stay those of the inner steps taken
        self._landed_since_step = self._held_tokens = 0
        self.inner.drop()
        self._weights_epoch += 1  # microbatches in flight began on the old weights: dropped when they land

    @property
    def inner_steps(self) -> int:
        return self.inner.steps

    @property
    def condemned(self) -> set[Peer]:
        """Servers whose work contradicted itself (a failed backward probe; banned now): the outer step leaves their
        pseudo-gradients out of the round. Unfit ones (``HopAudit.rest``) are not named: that is no verdict."""
        return self.remote.audit.condemned_now()

    @property
    def module(self) -> EdgeStage:
        """The stage this trainer holds (what the outer step exchanges)."""
        return self.edge

    async def exclusive(self, fn: Callable[[], T], *, change: WeightChange = "none") -> T:
        """``fn()`` on the edge thread, between microbatch computations (the outer step's snapshot and weight install).

        ``change="replaced"`` (a download): the gradients held for the next step, and those of every microbatch in
        flight (begun on the old weights), are dropped and counted (``round_dropped``), so none crosses it.
        ``"moved"`` (an outer round's install) keeps them: the move keeps this replica's progress, so they are one
        move stale, no more than across an inner step. Dropping them cost a microbatch per round, recomputed, while
        the stage servers had already stepped on it (their rounds ran ~4% ahead of stage 0's)."""
        if change != "replaced":
            return await self._run(fn)

        def replace() -> T:
            result = fn()
            self._drop_held_gradients()
            return result

        return await self._run(replace)

    def shutdown(self) -> None:
        self.remote.shutdown()
        self._executor.shutdown(wait=True, cancel_futures=True)
