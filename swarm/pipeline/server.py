"""A stage server: one middle stage computed for any trainer that calls it.

Forward caches its input (and its graph while ``--keep-graph-mb`` allows), backward differentiates that graph or
recomputes (on the weights the forward ran on, ``WeightStash``), gradients are screened before they accumulate, an
inner step is taken every ``train.inner_batch`` samples; torch work runs on one thread. More: docs/architecture.md.

    >>> await StageServicer(StageServer(cfg, stage=2), stage=2, max_request_bytes=1 << 20).add_p2p_handlers(p2p, namespace=ns)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from hivemind.p2p import PeerID
from hivemind.utils.performance_ema import PerformanceEMA

from compress.codec_base import Codec, all_finite
from optim.inner import GradNormScreen
from swarm.config import SwarmConfig
from swarm.dht.records import StageStatus
from swarm.hardware import CPU, available_memory, compute_precision
from swarm.model.stages import MiddleStage, build_stage
from swarm.model.step import (
    Gradients,
    InnerStep,
    WeightChange,
    add_gradients,
    graph_gradients,
    stage_forward,
    stage_forward_graph,
    stage_gradients,
)
from swarm.pipeline.cache import STASHED_STEPS, ActivationCache, CacheEntry, WeightCopy, WeightsAt, WeightStash
from swarm.pipeline.graphs import GraphSizer, KeptGraph, build_graph, graph_budget_bytes
from swarm.pipeline.inbound import InboundFrames
from swarm.pipeline.metering import BusyTime
from swarm.pipeline.pacing import Pace
from swarm.pipeline.protocol import Backward, Forward, Reply
from swarm.pipeline.timing import RequestTimes, TimeSplit, synchronize, timed_copy
from swarm.rpc.servicer import RequestError

T = TypeVar("T")


@dataclass(frozen=True)
class StageCompute:
    """A middle stage's weights, inner step and compute thread when another owner trains them too (a full peer that
    serves, ``swarm/node/roles/full.py``): requests then compute on those, between the owner's own calls on that thread."""

    module: MiddleStage
    inner: InnerStep
    executor: ThreadPoolExecutor

    @classmethod
    def build(
        cls, cfg: SwarmConfig, stage: int, *, device: torch.device, start_step: int = 0, lr_scale: float = 1.0
    ) -> StageCompute:
        """A stage server's own: the stage built on ``device``, its inner step and its compute thread."""
        module = build_stage(cfg.model, cfg.stages.num_stages, stage).to(device)
        assert isinstance(module, MiddleStage)  # 1 ≤ stage: the caller checked
        inner = InnerStep(
            module.parameters(), cfg.inner, inner_batch=cfg.train.inner_batch, start_step=start_step, lr_scale=lr_scale
        )
        return cls(module, inner, ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{stage}"))


class StageServer:
    """The ``StageBackend`` of one middle stage (see ``swarm/pipeline/protocol.py``).

    It builds the stage, its inner step and its compute thread, unless given them (``compute``): then the weights it
    serves are its owner's, and ``start_step`` and ``lr_scale`` are the owner's inner step's business.
    ``keep_graph_mb``: the budget of forward graphs kept for their backwards (``graph_budget_bytes``; None: auto);
    0 recomputes every forward. ``pace``: a benchmark's paced server (``swarm/pipeline/pacing.py``): it waits the
    reference device's time and replies with recorded tensors instead of computing; its weights never move.
    """

    def __init__(
        self,
        cfg: SwarmConfig,
        stage: int,
        *,
        start_step: int = 0,
        lr_scale: float = 1.0,
        max_cached: int = 64,
        clock: Callable[[], float] = time.perf_counter,
        busy_window_s: float = 30.0,
        device: torch.device = CPU,
        compute: StageCompute | None = None,
        keep_graph_mb: int | None = 0,
        pace: Pace | None = None,
    ) -> None:
        if not 1 <= stage <= cfg.stages.num_stages:
            raise ValueError(f"stage must be in [1, {cfg.stages.num_stages}], got {stage}")
        self.cfg, self.stage, self.clock = cfg, stage, clock
        self.device = device  # weights, gradients, optimizer states, and the frames decoded for them
        self._owns_compute = compute is None  # its thread is shut down with the server; an owner's is the owner's
        if compute is None:
            compute = StageCompute.build(cfg, stage, device=device, start_step=start_step, lr_scale=lr_scale)
        self.module, self.inner, self._executor = compute.module, compute.inner, compute.executor
        self.start_step = start_step  # a server that joins mid-run starts at the swarm's point of the lr schedule
        self.first_served_at: float | None = None  # unix time of the first forward served: how long joining took
        self.inbound = InboundFrames(cfg, device=device, clock=clock, name=f"stage{stage}-decode")
        max_values = self.inbound.limits.max_elements
        self.max_request_bytes = self.inbound.max_request_bytes
        budget = graph_budget_bytes(keep_graph_mb, available_memory(device) if keep_graph_mb is None else 0)
        self.cache = ActivationCache(
            max_items=max_cached, max_bytes=max_cached * 4 * max_values, max_graph_bytes=budget
        )
        self.graph_sizer, self.time_split = GraphSizer(), TimeSplit()  # kept graphs' bytes; time per request by part
        self.screen = GradNormScreen()  # of each microbatch's parameter gradients, before they accumulate
        self.throughput = PerformanceEMA(alpha=0.1, paused=True)  # samples/s over forward + backward compute
        self.busy = BusyTime(window_s=busy_window_s, clock=clock)  # forward + backward compute over wall time
        self.counters: Counter[str] = Counter()
        self.from_stage: Counter[int] = Counter()  # training inputs by the stage they came from: the paths seen
        self.weights_epoch = 0  # outer installs and downloads so far (``change_weights``)
        self.stash = WeightStash(keep=STASHED_STEPS)  # the weights pending forwards ran on, across inner steps
        self.pace = pace
        if pace is None:  # a paced server's weights never move: nothing to stash
            self.inner.before_step.append(self._stash_weights)

    async def forward(self, peer: PeerID, request: Forward) -> Reply:
        taken = self.clock()
        if not 0 <= request.prev_stage <= self.cfg.stages.num_stages or request.prev_stage == self.stage:
            raise RequestError(
                RequestError.INVALID,
                f"prev_stage {request.prev_stage} is not another stage of 0..{self.cfg.stages.num_stages}",
            )
        times = RequestTimes()
        codec, x, tokens = await self.inbound.input(request.x, times)
        why_not = self._why_no_graph(peer, x) if request.train else "eval"
        keep = why_not is None
        on = None if request.on_epoch is None or request.on_step is None else (request.on_epoch, request.on_step)
        (y, (weights, inner_step), graph), elapsed = await self._run(
            self._forward_at_step, x, keep, times, on, busy=True, times=times
        )
        if request.train:
            entry = CacheEntry(x=x, tokens=tokens, forward_s=elapsed, weights=weights, inner_step=inner_step)
            entry.graph, entry.no_graph = graph, why_not or entry.no_graph
            self.cache.put(peer, request.mb, entry, at=(self.weights_epoch, self.inner_steps))
            self.from_stage[request.prev_stage] += 1
        self.counters["forward" if request.train else "eval_forward"] += 1
        self.first_served_at = self.first_served_at or time.time()
        kind = "forward" if request.train else "eval_forward"
        return self._reply(codec, y.detach(), tokens, taken, times, kind, weights=(weights, inner_step))

    async def backward(self, peer: PeerID, request: Backward) -> Reply:
        taken = self.clock()
        entry = self.cache.pop(peer, request.mb)
        if entry is None:
            if request.x is None:
                self.counters["cache_miss"] += 1
                raise RequestError(RequestError.CACHE_MISS, f"no forward input for microbatch {request.mb}; resend it")
            _, x, tokens = await self.inbound.input(request.x, RequestTimes())
            entry = CacheEntry(x=x, tokens=tokens, forward_s=0.0, weights=self.weights_epoch)
            self.counters["recompute_from_resent"] += 1
        times = RequestTimes()
        codec, grad, _ = await self.inbound.gradient(request.grad, times)
        if grad.shape != entry.x.shape:
            raise RequestError(
                RequestError.INVALID,
                f"gradient of shape {tuple(grad.shape)} for an input of shape {tuple(entry.x.shape)}",
            )
        try:
            grad_x, elapsed = await self._run(self._compute_backward, entry, grad, peer, times, busy=True, times=times)
        except RequestError:
            self.counters["refused_gradient"] += 1
            raise
        self.throughput.update(entry.x.shape[0], interval=entry.forward_s + elapsed)
        self.counters["backward"] += 1
        return self._reply(codec, grad_x, None, taken, times, "backward")

    def _reply(
        self,
        codec: Codec,
        t: torch.Tensor,
        tokens: torch.Tensor | None,
        taken: float,
        times: RequestTimes,
        kind: str,
        *,
        weights: WeightsAt | None = None,
    ) -> Reply:
        """``t`` encoded, with our times (the rest of the trainer's round trip is its link's); into ``time_split``."""
        started = self.clock()
        frame = codec.encode(t, tokens=tokens) if self.pace is None else self.pace.encode(codec, t, tokens)
        times.encode_s = self.clock() - started
        self.time_split.add(kind, times)
        compute_s = times.compute_s + times.copy_s  # the compute thread's time, as the busy fraction counts it
        return Reply(frame, codec=codec.name, server_s=self.clock() - taken, compute_s=compute_s, weights=weights)

    def info(self) -> dict[str, Any]:
        recent, total = self.busy.fractions()
        return {
            **self.counters,
            "inner_steps": self.inner_steps,
            "samples_per_s": self.samples_per_s,
            "grad_norm": self.inner.grad_norm,
            "skipped_steps": self.inner.skipped,
            "cached": len(self.cache),
            "first_served_at": self.first_served_at,
            "evicted": self.cache.evicted,
            "from_stage": {str(k): v for k, v in sorted(self.from_stage.items())},
            "busy_fraction": recent,  # over the last busy.window_s
            "busy_fraction_total": total,  # since the first request
            "graphs": self.cache.graph_info(),  # the forward graphs kept for their backwards
            "time_split": self.time_split.summary(),  # median seconds per request by part (swarm/pipeline/timing.py)
        }

    @property
    def samples_per_s(self) -> float:
        return self.throughput.samples_per_second if self.throughput.num_updates else 0.0

    def status(self, *, queue: int) -> StageStatus:
        return StageStatus(
            samples_per_s=float(self.samples_per_s),
            queue=queue,
            inner_steps=self.inner_steps,
            grad_norm=float(self.inner.grad_norm),
        )

    async def exclusive(self, fn: Callable[[], T], *, change: WeightChange = "none") -> T:
        """``fn()`` on the compute thread, between requests (the outer step's snapshot and weight install), which
        changes the weights as ``change`` says (``change_weights``)."""
        return (await self._run(lambda: self.change_weights(fn, change)))[0]

    def change_weights(self, fn: Callable[[], T], change: WeightChange) -> T:
        """``fn()``, which changes the weights as ``change`` says (on the compute thread, between requests).

        "moved" (an outer install): forwards served before it still get their parameter gradients at their backward,
        differentiated at the weights they ran on (stashed now if any awaits its backward); waiting for no forward to
        be pending instead never ends under a trainer's window. "replaced" (a download): their input gradient still
        goes back, so the microbatch goes on, but their parameter gradients are left out (``stale_backward``).
        """
        if change == "moved" and len(self.cache):
            self.stash.take((self.weights_epoch, self.inner_steps), self.module)
        result = fn()
        if change != "none":
            self.weights_epoch += 1
        if change == "replaced":
            self.stash.clear()  # forwards on the old weights get no parameter gradient: their copies are of no use
        return result

    def _stash_weights(self, step: int) -> None:
        """Before an inner step (on the compute thread): keep the weights, for a forward on them awaiting its backward
        and for the backward probes of a backward just taken on them (they ask for these weights again)."""
        self.stash.take((self.weights_epoch, step), self.module)

    def shutdown(self) -> None:
        self.inbound.shutdown()
        if self._owns_compute:
            self._executor.shutdown(wait=True, cancel_futures=True)

    async def _run(
        self, fn: Callable[..., T], *args: Any, busy: bool = False, times: RequestTimes | None = None
    ) -> tuple[T, float]:
        """``fn(*args)`` on the compute thread, and its compute time (waiting for the thread excluded, the device's
        queued work included), counted into the busy fraction if ``busy`` (a request's compute), refused or not;
        ``times`` gets the wait and the compute time less the copies ``fn`` timed into it."""
        submitted = self.clock()

        def timed() -> tuple[T, float]:
            started = self.clock()
            try:
                result = fn(*args)
            finally:
                synchronize(self.device)  # the device's queued work is this call's (a no-op on the CPU)
                ended = self.clock()
                if busy:
                    self.busy.add(started, ended)
                if times is not None:
                    times.wait_s, times.compute_s = started - submitted, ended - started - times.copy_s
            return result, ended - started

        return await asyncio.get_running_loop().run_in_executor(self._executor, timed)

    @property
    def inner_steps(self) -> int:
        return self.inner.steps

    def _why_no_graph(self, peer: Hashable, x: torch.Tensor) -> str | None:
        """``ActivationCache.why_no_graph`` of this forward: its graph's predicted bytes, the samples until a step."""
        nbytes, due_in = self.graph_sizer.predict(x.shape[0] * x.shape[1]), self.inner.inner_batch - self.inner.samples
        return self.cache.why_no_graph(peer, nbytes, due_in)

    def _forward_at_step(
        self, x: torch.Tensor, keep: bool, times: RequestTimes, on: WeightsAt | None = None
    ) -> tuple[torch.Tensor, WeightsAt, KeptGraph | None]:
        """The forward, the weights it ran on, its graph if kept. Read here, on the compute thread, where weights
        change: read back on the event loop, an outer install queued behind this forward would already count, and
        the backward would take the kept graph of weights since moved in place. ``on``: the weights to run on, if not
        the current ones (a backward probe's: the stashed copy, refused once it is gone)."""
        if self.pace is not None:  # the reference device's forward time, and the recorded output
            return self.pace.forward(self.stage, x.shape[0]), (self.weights_epoch, self.inner_steps), None
        on_device = timed_copy(x, self.device, times, self.clock)
        at = (self.weights_epoch, self.inner_steps)
        if on is not None and on != at:
            if (stashed := self.stash.get(on)) is None:
                raise RequestError(RequestError.GONE, f"weights {on} are no longer held (now at {at})")
            with compute_precision(self.device, self.cfg.train.precision):
                return stage_forward(self.module, on_device, weights=stashed), on, None
        if not keep:
            return self._compute_forward(on_device), at, None
        with compute_precision(self.device, self.cfg.train.precision):
            graph = build_graph(self.module, x, on_device, self.graph_sizer)
        return graph.y, at, graph

    def _compute_forward(self, x: torch.Tensor) -> torch.Tensor:
        with compute_precision(self.device, self.cfg.train.precision):
            return stage_forward(self.module, x.to(self.device))  # (B, T, d) → (B, T, d)

    def _compute_backward(
        self, entry: CacheEntry, grad: torch.Tensor, peer: Hashable, times: RequestTimes | None = None
    ) -> torch.Tensor:
        x = entry.x
        if self.pace is not None:  # the reference device's backward time, the recorded gradient; the step is counted
            self.counters["paced_backward"] += 1
            self.inner.add(x.shape[0])  # no gradient accumulated: the optimizer steps nothing
            return self.pace.backward(self.stage, x.shape[0])
        moved_steps = 0 if entry.inner_step is None else self.inner_steps - entry.inner_step  # since its forward
        moved = moved_steps > 0 or entry.weights != self.weights_epoch  # by inner steps or an outer install
        stashed = self.stash.get((entry.weights, entry.inner_step)) if moved and entry.inner_step is not None else None
        grad_x, grads = self._gradients(entry, grad, moved, stashed, times or RequestTimes())
        norm = float(torch.nn.utils.get_total_norm([g for g in grads if g is not None]))
        verdict = self.screen.judge(norm, peer)  # by the stage's own statistics: clipped, weighed or refused
        refusal = verdict.refusal or (None if all_finite(grad_x) else "the input gradient is not finite")
        if refusal is not None:  # the sender's gradient would poison the batch: refused before it counts
            raise RequestError(RequestError.INVALID, f"microbatch gradient refused: {refusal}")
        if (
            entry.weights != self.weights_epoch and stashed is None
        ):  # its forward's weights are gone (a download, or old)
            self.counters["stale_backward"] += 1
            return grad_x
        self.screen.accept(verdict, peer)
        self.counters["clipped_gradient"] += verdict.clipped
        if stashed is not None:  # differentiated at the stashed weights its forward ran on
            self.counters["stashed_backward"] += 1
        elif moved:
            # recomputed on weights an inner step (other microbatches' samples) has moved since its forward, and
            # older than the stash keeps: the gradient is of weights its output never came from; counted, with the
            # steps between
            self.counters["stale_recompute"] += 1
            self.counters["stale_recompute_steps"] += moved_steps
        verdict.scale_(grads)
        add_gradients(self.module, grads)
        self.inner.add(x.shape[0])  # step 6
        return grad_x  # (B, T, d)

    def _gradients(
        self, entry: CacheEntry, grad: torch.Tensor, moved: bool, stashed: WeightCopy | None, times: RequestTimes
    ) -> tuple[torch.Tensor, Gradients]:
        """Step 4 of swarm/model/step.py, held apart: from the forward's kept graph while the weights have not moved
        since (updated in place), else recomputed from the input (at the stashed weights of that forward, if any)."""
        graph, entry.graph = entry.graph, None  # freed with this call, used or not
        grad = timed_copy(grad, self.device, times, self.clock)
        if graph is not None and not moved:
            self.counters["graph_kept_backward"] += 1
            return graph_gradients(self.module, graph.x, graph.y, grad)
        if self.cache.max_graph_bytes > 0 and entry.inner_step is not None:  # a resent input never had a graph
            self.counters[f"graph_{'moved' if graph is not None else entry.no_graph}_recompute"] += 1
        graph, times.recomputed = None, True
        x = timed_copy(entry.x, self.device, times, self.clock)
        with compute_precision(self.device, self.cfg.train.precision):
            return stage_gradients(self.module, x, grad, weights=stashed)


def warm_up(server: StageServer) -> float:
    """A forward and a backward of each kind ``server`` runs (plain, graph kept, recomputed), on zeros at the swarm's
    microbatch shape, with nothing counted: the seconds they took. A compiled stage traces and compiles at its first
    calls, tens of seconds on a GPU, so it does this before it takes requests (on its compute thread: ``exclusive``):
    a trainer gives a new server 16× its stage's p95, and two missed deadlines in a row would ban it (deadlines.py)."""
    train, device, module = server.cfg.train, server.device, server.module
    x = torch.zeros(train.microbatch_size, train.seq_len, server.cfg.model.d_model, device=device)  # (B, T, d)
    started = time.perf_counter()
    with compute_precision(device, train.precision):
        stage_forward(module, x)
        leaf, y = stage_forward_graph(module, x)
        graph_gradients(module, leaf, y, torch.zeros_like(y))
        stage_gradients(module, x, torch.zeros_like(x))
    synchronize(device)
    return time.perf_counter() - started
