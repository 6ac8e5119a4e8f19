"""The trainer loop: data → stage 0 → a sampled path of stage servers → loss → backward along the same hops.

``Trainer`` holds the edge stage (labels never leave it) and keeps a transport ``Window`` of microbatches in
flight across inner steps, within ``max_staleness``; ``RemoteStages`` carries each one's frames along its hops
(a replica per hop, a codec per link from ``LinkCodecs``, retries, resent inputs). The math is
``swarm/model/step.py``'s. Window, staleness and drops: docs/architecture.md, pipeline/.

    >>> await Trainer(cfg, StageClient(p2p, namespace=cfg.swarm_id), router).train(batches, steps=100, on_log=print)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from compress.adaptive import Ladder, LinkEstimator, choose_codec
from compress.codecs import BOUNDARY_MAX_ABS, Codec
from compress.errors import WireError
from swarm.config import SwarmConfig, cli
from swarm.dht.metrics import Traffic
from swarm.dht.records import StageStatus, verdicts
from swarm.hardware import CPU, compute_precision
from swarm.model.stages import EDGE_STAGE, EdgeStage, build_stage
from swarm.model.step import (
    Gradients,
    InnerStep,
    WeightChange,
    add_gradients,
    embed,
    embed_backward,
    head_gradients,
)
from swarm.model.transformer import loss_fn
from swarm.pipeline.boundary import boundary_ladders
from swarm.pipeline.checking import CheckRule, HopChecker
from swarm.pipeline.deadlines import DeadlineRule, Deadlines
from swarm.pipeline.probing import (
    PROBED_CODECS,
    BackwardProbes,
    ProbeRule,
    descent,
    passes,
    probe_steps,
    resolved,
)
from swarm.pipeline.protocol import KEEPALIVE_S, Backward, Forward, needs_stream
from swarm.pipeline.routing import NoLiveReplica, Peer, Router, path_length
from swarm.rpc.servicer import RemoteError, RequestError

logger = logging.getLogger(__name__)
Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), (B, T) int64 each
T = TypeVar("T")
# microbatches: started = completed + failed + cancelled (on shutdown) + in flight; of the completed, those whose
# stage-0 gradients were dropped: landed more than max_staleness inner steps after their start, or began before a
# download replaced the weights (with those landed since the last inner step; the name is older); hops: failed attempts (retried
# elsewhere), timeouts (deadlines missed), stages skipped on the way forward, inputs resent for a backward; bans for
# deadlines missed in a row; checked forwards (checking.py): checks done, disagreements, servers condemned by a
# referee (or by failed backward probes), disagreements no referee could settle; probed backwards (probing.py): probes
# judged, probes failed, probes whose step the replies' rounding swallowed
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
    "probes",
    "probe_failures",
    "probes_unresolved",
)


class StageCalls(Protocol):
    """Each call returns the reply frame; a ``Reply`` (``StageClient``'s, ``StageServer``'s) also carries the server's
    timings, which measure the link: a link answered in plain bytes stays unmeasured."""

    async def forward(self, peer: Peer, request: Forward, *, timeout: float) -> bytes: ...

    async def backward(self, peer: Peer, request: Backward, *, timeout: float) -> bytes: ...


@dataclass(kw_only=True)
class TrainerOptions:
    in_flight: int = field(
        default=4,
        metadata=cli(
            "Trainers: the most microbatches in flight at once, across inner steps (the window's cap; the window "
            "itself follows round trip × delivery rate); 1 is the synchronous pipeline.",
            min=1,
        ),
    )
    # inner steps a microbatch may land after its forward began; the window never starts one that would land staler
    # in order, and drops one overtaken past it. 0 (the default): the window stays within an inner step, so with one
    # microbatch per inner step the pipeline is synchronous. Measured (docs/benchmarks.md): spanning steps (6, with a
    # cap of 4) keeps 0.82 of the uncapped tokens/s at 20 Mbit/s instead of 0.53, but trains 9% worse at equal tokens
    # (the servers recompute a backward on weights newer than its forward's), so it is a choice, not the default
    max_staleness: int = field(
        default=0,
        metadata=cli(
            "Trainers: inner steps a microbatch may land after its forward began; staler ones are not started, "
            "or their gradients are dropped (counted). 0 keeps the window within an inner step (no staleness); "
            "more lets it span steps: faster over slow links, at a quality cost (docs/benchmarks.md).",
            min=0,
        ),
    )

    max_attempts: int = (
        3  # replicas tried per hop before the stage is skipped (forward) or the microbatch fails (backward)
    )
    max_failures_in_a_row: int = 50  # then the swarm is unusable: stop with an error instead of spinning
    log_every: int = 10  # inner steps between progress records
    check_rate: float = field(
        default=0.02,
        metadata=cli(
            "Trainers: fraction of forward hops recomputed by another replica of the stage and compared (checked "
            "pipeline work: every forward of a server until it passed one check, more of new and suspect servers); "
            "0 turns checking off.",
            min=0.0,
        ),
    )
    probe_rate: float = field(
        default=0.0,
        metadata=cli(
            "Trainers: fraction of backward hops probed by two forwards of the same server at x ± εg, which must "
            "confirm the input gradient it returned (every backward of a server until it passed two probes; two "
            "failures in eight condemn it). Off by default: a server that takes an inner step between its backward "
            "and the probe fails it honestly (docs/architecture.md).",
            min=0.0,
        ),
    )
    check_tolerance: float = 1.0  # relative L2 error within which two replicas' outputs agree (checking.py)
    deadline_multiple: float = 4.0  # a hop's deadline: this × the server's recent p95 service time (deadlines.py)
    deadline_floor_s: float = 2.0  # the least time a hop gets
    deadline_misses: int = 2  # deadlines missed in a row (no success between) that ban a server, for a growing back-off
    eval_every: int = field(
        default=0, metadata=cli("Trainers: validation pass every N inner steps (0: only at the end).", min=0)
    )

    def __post_init__(self) -> None:
        if (
            min(self.in_flight, self.max_attempts, self.max_failures_in_a_row, self.log_every, self.deadline_misses) < 1
            or min(self.eval_every, self.max_staleness) < 0
            or not 0.0 <= self.check_rate <= 1.0
            or not 0.0 <= self.probe_rate <= 1.0
            or min(self.check_tolerance, self.deadline_floor_s) <= 0
            or self.deadline_multiple < 1
        ):
            raise ValueError(f"trainer options must be positive (eval_every, max_staleness non-negative), got {self}")


@dataclass(frozen=True)
class Microbatch:
    id: str
    shape: tuple[int, ...]  # (B, T, d): every activation and gradient frame it sends has this shape
    train: bool


@dataclass(frozen=True)
class Hop:
    stage: int
    peer: Peer
    x: bytes  # the frame this hop received: resent if its server loses it
    x_codec: str  # its codec
    prev_stage: int  # the stage x came from (a probe's forward names it, as the hop's did)


class Outgoing:
    """A boundary tensor on its way to the next hop: encoded once per codec a link asks for, the frame it arrived in
    relayed as is when the link's codec is that frame's (no second rounding)."""

    def __init__(
        self, value: torch.Tensor, tokens: torch.Tensor | None, frame: bytes | None = None, codec: Codec | None = None
    ) -> None:
        self.value, self.tokens = value, tokens
        self._frames: dict[str, bytes] = {} if frame is None or codec is None else {codec.name: frame}

    def frame(self, codec: Codec) -> bytes:
        if codec.name not in self._frames:
            self._frames[codec.name] = codec.encode(self.value, tokens=self.tokens)
        return self._frames[codec.name]


class LinkCodecs:
    """The codec of every frame a trainer sends, per kind and destination peer: the one place the choice is made.

    Each kind has its ladder (a fixed codec: a ladder of one); links are measured from the RPCs that complete
    (``observe``), and ``report`` says per link what was chosen last and what was measured."""

    def __init__(self, ladders: dict[str, Ladder]) -> None:
        self.ladders = ladders  # "activations", "gradients"
        self.links = LinkEstimator()
        self.chosen: dict[Peer, dict[str, str]] = {}

    def choose(self, kind: str, peer: Peer, shape: tuple[int, ...]) -> Codec:
        codec = choose_codec(self.ladders[kind], shape, self.links.get(peer))
        self.chosen.setdefault(peer, {})[kind] = codec.name
        return codec

    def observe(self, peer: Peer, reply: bytes, *, nbytes: int, elapsed_s: float) -> None:
        server_s, compute_s = getattr(reply, "server_s", None), getattr(reply, "compute_s", None)
        self.links.observe(peer, nbytes=nbytes, elapsed_s=elapsed_s, server_s=server_s, compute_s=compute_s)

    def report(self) -> dict[str, dict[str, Any]]:
        """Per peer: the codec chosen last for each kind, and the link's estimated bytes/s and compute per call."""
        report = {}
        for peer, chosen in self.chosen.items():
            link = self.links.get(peer)
            measured = {} if link is None else {"bytes_per_s": link.bytes_per_s, "compute_s": link.compute_s}
            report[str(peer)] = {**{f"codec_{kind}": name for kind, name in chosen.items()}, **measured}
        return report


@dataclass(frozen=True)
class Departure:
    """What a training microbatch is stamped with when it starts, to judge it when it lands."""

    inner_steps: int  # stage 0's steps then: its staleness is the steps taken before it lands
    weights: int  # stage 0's weights epoch then (``Trainer.exclusive(change="replaced")`` starts a new one)
    at: float  # perf_counter then
    delivered: int  # microbatches landed before it started (``Window.delivered``)


class Window:
    """How many microbatches to keep in flight: a transport window over the pipeline.

    Its size is the bandwidth-delay product, as BBR measures it — the highest recent delivery rate
    (microbatches landed during one microbatch's round trip ÷ that round trip) × the lowest recent
    round trip — rounded up, plus one: the next microbatch always waits at the bottleneck, and while
    the pipeline has room (round trips stay at their minimum) each landing lets the window grow by
    one. Clamped to [1, ``cap``]; it starts at 1.

    That one waiting microbatch lengthens every round trip by a service time, and a window sized on
    such round trips would grow without end. So, as BBR's ProbeRTT, every ``probe_every`` landings
    the window drops the extra one until a microbatch started after that lands: its round trip,
    without our own queue, stays in the ``history`` the lowest one is taken from.

        >>> window = Window(cap=4)
        >>> delivered, started = window.delivered, time.perf_counter()  # when a microbatch starts
        >>> window.land(delivered, started, now=time.perf_counter())  # when it lands: the new ``window.size``
    """

    def __init__(self, cap: int, *, history: int = 64, probe_every: int = 32) -> None:
        self.cap, self.size = cap, 1
        self.delivered = 0  # microbatches landed (their gradients used or dropped)
        self._round_trips: deque[float] = deque(maxlen=history)  # seconds, start to landing
        self._rates: deque[float] = deque(maxlen=history)  # microbatches per second
        self._probe_every, self._probed_at = probe_every, 0  # landings between probes; delivered at the last one
        self._probe_since: float | None = None  # when the probe in progress began

    def land(self, delivered_before: int, started: float, *, now: float) -> int:
        """A microbatch that started at ``started`` when ``delivered_before`` had landed has landed now."""
        self.delivered += 1
        round_trip = max(now - started, 1e-6)
        self._round_trips.append(round_trip)
        self._rates.append((self.delivered - delivered_before) / round_trip)
        if self._probe_since is not None and started >= self._probe_since:
            self._probe_since = None  # measured without the extra microbatch
        elif self._probe_since is None and self.delivered - self._probed_at >= self._probe_every:
            self._probe_since, self._probed_at = now, self.delivered
        headroom = 0 if self._probe_since is not None else 1
        self.size = max(1, min(self.cap, math.ceil(self.in_flight_estimate - 1e-6) + headroom))
        return self.size

    @property
    def round_trip_s(self) -> float | None:
        """The lowest recent round trip: the pipeline's latency without queueing."""
        return min(self._round_trips, default=None)

    @property
    def microbatches_per_s(self) -> float | None:
        """The highest recent delivery rate."""
        return max(self._rates, default=None)

    @property
    def in_flight_estimate(self) -> float:
        """The bandwidth-delay product: microbatches in flight that keep the pipeline full, without a queue."""
        return (self.microbatches_per_s or 0.0) * (self.round_trip_s or 0.0)


class HopFailed(Exception):
    """Every replica tried for a hop failed, or none is live."""


class CacheMiss(Exception):
    """The server no longer holds the microbatch's forward input."""


class RemoteStages:
    """The middle stages as a trainer reaches them: a replica chosen per hop, each frame coded for its link, a failed
    call retried on another replica (a lost forward input resent), and the router, the link estimates and the
    trainer's counters and traffic told how every call went. Each call's deadline follows its server's service times
    (``Deadlines``); a sampled fraction of training forwards is recomputed by another replica, off the microbatch's
    critical path, and a server a referee finds wrong is condemned and routed around (``HopChecker``)."""

    def __init__(
        self,
        cfg: SwarmConfig,
        calls: StageCalls,
        router: Router,
        options: TrainerOptions,
        *,
        codecs: LinkCodecs,
        counters: Counter[str],
        traffic: Traffic,
        fp32_bytes: Counter[str],
        device: torch.device = CPU,
    ) -> None:
        self.cfg, self.calls, self.router, self.options = cfg, calls, router, options
        # replies are decoded onto the trainer's device (only their coded bytes cross) on a thread of their own: off
        # the event loop, whose wait for the device (the decode's finiteness check) would stall every call in flight
        self.device, self._decoder = device, ThreadPoolExecutor(max_workers=1, thread_name_prefix="replies")
        self.codecs, self.counters, self.traffic, self.fp32_bytes = codecs, counters, traffic, fp32_bytes
        self.deadlines = Deadlines(
            DeadlineRule(
                rpc_s=cfg.timeouts.rpc_s,
                multiple=options.deadline_multiple,
                floor_s=options.deadline_floor_s,
                misses=options.deadline_misses,
            )
        )
        rate = options.check_rate  # 0: off, probation and suspects included (the cost measurement's baseline)
        rule = (
            CheckRule(rate=rate, tolerance=options.check_tolerance)
            if rate
            else CheckRule(
                rate=0.0, first_checks=0, probation_rate=0.0, suspect_rate=0.0, tolerance=options.check_tolerance
            )
        )
        self.checker = HopChecker(rule)
        # backwards judged by the server's own forward (probing.py)
        probe_rate = options.probe_rate
        self.probes = BackwardProbes(ProbeRule(rate=probe_rate) if probe_rate else ProbeRule(rate=0.0, first_probes=0))
        self._checks: set[asyncio.Task[Any]] = set()  # checks under way, off the microbatches' paths
        self._ids = itertools.count()  # microbatch ids: a probe's forwards look like any microbatch's

    def new_id(self, prefix: str = "mb") -> str:
        return f"{prefix}{next(self._ids)}"

    async def forward_path(
        self, mb: Microbatch, path: list[int], h0: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[list[Hop], torch.Tensor]:
        """The hops taken and the decoded output of the last one (``h0`` itself if none was)."""
        hops, prev, outgoing = [], EDGE_STAGE, Outgoing(h0, tokens)
        for stage in path:
            try:
                hop, outgoing = await self.forward_hop(mb, stage, prev, outgoing)
            except HopFailed as e:
                self.counters["skipped_hops"] += 1  # go on without this stage, as SkipPipe paths do
                logger.warning(f"{mb.id}: skipping stage {stage}: {e}")
                continue
            hops.append(hop)
            prev = stage
        return hops, outgoing.value

    async def forward_hop(self, mb: Microbatch, stage: int, prev: int, x: Outgoing) -> tuple[Hop, Outgoing]:
        tried: list[Peer] = []
        for _ in range(self.options.max_attempts):
            peer = self._choose(stage, tried)
            tried.append(peer)
            codec = self.codecs.choose("activations", peer, mb.shape)
            frame = x.frame(codec)
            request = Forward(mb=mb.id, stage=stage, prev_stage=prev, x=frame, train=mb.train)
            if (reply := await self._call(mb, peer, request, codec.name)) is not None:
                if mb.train and self.checker.should_check(peer):
                    check = self._check(mb, request, codec.name, peer, reply[0])
                    if self.checker.unproven(peer):  # a new or suspect server's checked reply lands once it passed
                        await check
                        if self.checker.is_condemned(peer):
                            continue  # this hop again, on another replica
                    else:
                        task = asyncio.create_task(check)
                        self._checks.add(task)
                        task.add_done_callback(self._checks.discard)
                return Hop(stage, peer, frame, codec.name, prev), Outgoing(*reply)
        raise HopFailed(f"stage {stage}: {len(tried)} replicas failed")

    async def _check(self, mb: Microbatch, request: Forward, codec: str, peer: Peer, y: torch.Tensor) -> None:
        """The hop's forward again, on another replica (and a third if the two disagree): the odd one out condemned."""
        try:
            stage = request.stage
            checker_peer, y_checker = await self._recompute(mb, request, codec, [peer])
            if checker_peer is None or y_checker is None:
                return  # no other replica, or it failed: unchecked
            self.counters["checks"] += 1
            if self.checker.agree(y, y_checker):
                self.checker.clear(peer)
                self.checker.clear(checker_peer)
                return
            self.counters["check_disagreements"] += 1
            referee, z = await self._recompute(mb, request, codec, [peer, checker_peer])
            if z is None:  # no third replica: the trainer's loss spikes on each one's paths may tell
                wrong = self.checker.tie_break(peer, checker_peer)
            else:
                wrong = self.checker.referee(peer, y, checker_peer, y_checker, z)
            if wrong is None:
                self.counters["checks_unresolved"] += 1
                self.checker.suspect(peer, checker_peer, *([] if referee is None else [referee]))
                logger.warning(f"stage {stage}: {peer} and {checker_peer} disagree on {mb.id}; no referee settled it")
                return
            self._condemn(stage, wrong, mb)
        except Exception as e:  # a check is a side job: it must never take the trainer down
            logger.warning(f"check of {mb.id} at stage {request.stage} failed: {type(e).__name__}: {e}")

    async def _recompute(
        self, mb: Microbatch, request: Forward, codec: str, tried: list[Peer]
    ) -> tuple[Peer | None, torch.Tensor | None]:
        """Another replica's output for the same input (its forward not kept: ``train=False``), or Nones."""
        try:
            peer = self._choose(request.stage, tried)
        except HopFailed:
            return None, None
        again = Forward(
            mb=f"{mb.id}.check{len(tried)}",
            stage=request.stage,
            prev_stage=request.prev_stage,
            x=request.x,
            train=False,
        )
        reply = await self._call(mb, peer, again, codec)
        return peer, None if reply is None else reply[0]

    def _probeable(self, peer: Peer, shape: tuple[int, ...]) -> bool:
        """The link's codecs round finely enough for a probe to judge (``PROBED_CODECS``)."""
        return all(self.codecs.choose(kind, peer, shape).name in PROBED_CODECS for kind in ("activations", "gradients"))

    async def _probe(self, mb: Microbatch, hop: Hop, peer: Peer, u: torch.Tensor, g: torch.Tensor) -> bool:
        """Two ordinary forwards of ``peer`` at x ± εg judge the gradient g it returned (probing.py); False if it failed
        (True if it could not be judged: no answer, which the deadlines deal with)."""
        try:
            _, x, tokens = await self._decode("activations", hop.x, mb.shape)
            eps = probe_steps(x, g, self.probes.step(peer))
            outputs = []
            for sign in (1.0, -1.0):
                probe = Microbatch(self.new_id(), mb.shape, train=True)
                codec = self.codecs.choose("activations", peer, mb.shape)
                frame = Outgoing(x + sign * eps * g.to(x), tokens).frame(codec)
                request = Forward(mb=probe.id, stage=hop.stage, prev_stage=hop.prev_stage, x=frame, train=True)
                if (reply := await self._call(probe, peer, request, codec.name)) is None:
                    return True
                outputs.append(reply[0])
            if resolved(*outputs) < self.probes.rule.min_resolved:  # the reply's rounding swallowed the step
                self.counters["probes_unresolved"] += 1
                self.probes.unresolved(peer)
                return True
            judged = descent(u.to(outputs[0].device), outputs[0], outputs[1], eps, g.to(outputs[0].device))
        except Exception as e:  # a probe is a side job: it must never take the trainer down
            logger.warning(f"probe of {mb.id} at stage {hop.stage} failed: {type(e).__name__}: {e}")
            return True
        self.counters["probes"] += 1
        passed = passes(judged, self.probes.rule)
        self.counters["probe_failures"] += not passed
        if self.probes.record(peer, judged):
            self._condemn(hop.stage, peer, mb, why="its backward points against its own forward's gradient")
        elif not passed:
            logger.warning(f"stage {hop.stage}: {peer}'s backward of {mb.id} failed a probe (descent {judged:.3f})")
        return passed

    def _condemn(self, stage: int, peer: Peer, mb: Microbatch, *, why: str = "") -> None:
        seconds = self.checker.condemn(peer)
        self.counters["check_strikes"] += 1
        reason = why or f"its forward of {mb.id} disagreed with two other replicas"
        self.router.ban(stage, peer, seconds, reason=reason)
        logger.warning(f"stage {stage}: {peer} condemned ({reason}); banned for {seconds:.0f} s")

    async def close(self) -> None:
        """Cancel the checks under way."""
        for task in list(self._checks):
            task.cancel()
        await asyncio.gather(*self._checks, return_exceptions=True)

    async def backward_hop(self, mb: Microbatch, hop: Hop, grad: Outgoing) -> Outgoing:
        """Gradient w.r.t. the hop's input: from its server, else from any replica given the input again. The one that
        answered may have it probed (``_probe``): off the path once it passed its first probes, else before it lands
        (a failed one is redone on another replica)."""
        peer, tried, resend = hop.peer, [hop.peer], False
        for _ in range(self.options.max_attempts):
            self.counters["resent_inputs"] += resend
            codec = self.codecs.choose("gradients", peer, mb.shape)
            request = Backward(mb=mb.id, stage=hop.stage, grad=grad.frame(codec), x=hop.x if resend else None)
            try:
                reply = await self._call(mb, peer, request, codec.name, hop.x_codec)
            except CacheMiss:  # the server dropped the input: resend it, to the same server
                resend = True
                continue
            if reply is not None:
                returned = Outgoing(*reply)
                if not mb.train or not self.probes.should_probe(peer) or not self._probeable(peer, mb.shape):
                    return returned
                probe = self._probe(mb, hop, peer, grad.value, returned.value)
                if not self.probes.unproven(peer):  # off the microbatch's path
                    task = asyncio.create_task(probe)
                    self._checks.add(task)
                    task.add_done_callback(self._checks.discard)
                    return returned
                if await probe:  # a new or suspect server's gradient lands once its probe passed
                    return returned
            resend = True  # another replica never saw this microbatch (or the last one's gradient failed its probe)
            peer = self._choose(hop.stage, tried)
            tried.append(peer)
        raise HopFailed(f"backward of stage {hop.stage}: {len(tried)} attempts failed")

    def _choose(self, stage: int, tried: list[Peer]) -> Peer:
        """A replica of ``stage`` not in ``tried`` and not condemned (its router ban may have ended with a DHT
        re-listing, which forgets bans)."""
        exclude = set(tried) | self.checker.condemned_now()
        try:
            return self.router.choose(stage, task_size=self.cfg.train.microbatch_size, exclude=exclude)
        except NoLiveReplica as e:
            raise HopFailed(f"stage {stage}: {e}") from None

    async def _call(
        self, mb: Microbatch, peer: Peer, request: Forward | Backward, codec: str, x_codec: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, bytes, Codec] | None:
        """One RPC, with the router and the link estimate told how it went: the reply (decoded, its token ids, the
        frame, its codec), or None to move on. ``codec``: the request's frame's; ``x_codec``: a resent input's."""
        stage, started = request.stage, time.perf_counter()
        if isinstance(request, Forward):
            kind, frame, resent = "activations", request.x, None
        else:
            kind, frame, resent = "gradients", request.grad, request.x
        sent = self._count(mb, kind, frame, sent=True, codec=codec)
        if resent is not None:
            sent += self._count(mb, "activations", resent, sent=True, codec=x_codec)
        timeout = self._deadline(peer, request, sent)
        try:
            out = await self._send(peer, request, timeout)
            wire_and_server_s = time.perf_counter() - started  # the link's measure: our decode below is no part of it
            received = self._count(mb, kind, out, sent=False)
            # a bad reply is this server's fault, not the next hop's; one of another shape is refused from its header
            reply_codec, value, tokens = await self._decode(kind, out, mb.shape)
        except TimeoutError:
            self._missed(stage, peer, timeout)
            return None
        except RemoteError as e:
            if e.code == RequestError.CACHE_MISS:
                raise CacheMiss(str(e)) from None
            self.counters["hop_failures" if e.code == RequestError.UNREACHABLE else f"hop_refused_{e.code}"] += 1
            # busy: alive but loaded; invalid: it refused what this trainer sent (a gradient its screen would not
            # take, a frame it could not read): this trainer's fault, not the server's. Either way charge it the
            # time (a server refusing everything falls behind in the routing) but do not ban it.
            if e.code in (RequestError.BUSY, RequestError.INVALID):
                self.router.report_timeout(stage, peer, time.perf_counter() - started, reason=str(e))
            else:
                self.router.report_failure(stage, peer, reason=str(e))
            logger.info(f"stage {stage} peer {peer}: {e}")
            return None
        except WireError as e:  # the reply does not decode
            self.counters["hop_failures"] += 1
            self.router.report_failure(stage, peer, reason=f"unreadable reply: {type(e).__name__}: {e}")
            logger.info(f"stage {stage} peer {peer}: call failed: {type(e).__name__}: {e}")
            return None
        elapsed = time.perf_counter() - started
        self.router.report_success(stage, peer, samples=mb.shape[0], seconds=elapsed)
        self.deadlines.observe(stage, peer, elapsed)
        self.codecs.observe(peer, out, nbytes=sent + received, elapsed_s=wire_and_server_s)
        return value, tokens, out, reply_codec

    async def _decode(
        self, kind: str, frame: bytes, shape: tuple[int, ...]
    ) -> tuple[Codec, torch.Tensor, torch.Tensor | None]:
        """A reply's codec, tensor (on the trainer's device) and token ids, decoded on the decoding thread."""

        def decode() -> tuple[Codec, torch.Tensor, torch.Tensor | None]:
            return self.codecs.ladders[kind].decode(
                frame, expected_shape=shape, max_abs=BOUNDARY_MAX_ABS, device=self.device
            )

        return await asyncio.get_running_loop().run_in_executor(self._decoder, decode)

    def shutdown(self) -> None:
        """Stop the decoding thread (the trainer's end; ``close`` ends a run's checks)."""
        self._decoder.shutdown(wait=True, cancel_futures=True)

    def _deadline(self, peer: Peer, request: Forward | Backward, sent: int) -> float:
        """This call's deadline: from the server's service times, the link's transfer estimate for a reply as large as
        the request (a frame larger than those measured gets its time), and for a streamed call room for its
        keep-alives (its deadline is a bound on silence)."""
        link = self.codecs.links.get(peer)
        transfer_s = 0.0 if link is None else link.round_trip_s(sent) + link.compute_s
        frame = request.x if isinstance(request, Forward) else request.grad
        floor_s = 2 * KEEPALIVE_S if needs_stream(frame, request) else 0.0
        return self.deadlines.deadline(request.stage, peer, transfer_s=transfer_s, floor_s=floor_s)

    def _missed(self, stage: int, peer: Peer, timeout: float) -> None:
        """A deadline missed: charged as busy time, and after ``deadline_misses`` in a row a ban (growing)."""
        self.counters["hop_timeouts"] += 1
        reason = f"no reply within its deadline of {timeout:.1f} s"
        if self.deadlines.miss(stage, peer):
            self.counters["deadline_bans"] += 1
            self.router.report_failure(stage, peer, reason=f"{reason}, {self.deadlines.misses(stage, peer)} in a row")
        else:
            self.router.report_timeout(stage, peer, timeout, reason=reason)

    async def _send(self, peer: Peer, request: Forward | Backward, timeout: float) -> bytes:
        if isinstance(request, Forward):
            return await self.calls.forward(peer, request, timeout=timeout)
        return await self.calls.backward(peer, request, timeout=timeout)

    def _count(self, mb: Microbatch, kind: str, frame: bytes, *, sent: bool, codec: str | None = None) -> int:
        """The one count of a trainer's wire traffic (and of the frames it sends by ``codec``); fp32_bytes: what the
        same tensor would cost uncompressed. Returns the frame's bytes."""
        kind = kind if mb.train else "eval"  # validation traffic apart: per-token costs are of training
        (self.traffic.sent if sent else self.traffic.received)[kind] += len(frame)
        self.fp32_bytes[kind] += 4 * math.prod(mb.shape)
        if codec is not None:
            self.traffic.frames[codec] += 1
        return len(frame)


class Trainer:
    """Stage 0 (embedding, head, loss) and its inner step, keeping a window of microbatches going through the
    middle stages (``RemoteStages``) and landing each one's gradients."""

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
    ) -> None:
        self.cfg, self.router = cfg, router
        self.options = options or TrainerOptions()
        self.device = device  # the edge stage's; token batches and decoded frames are moved here
        self.edge = build_stage(cfg.model, cfg.stages.num_stages, EDGE_STAGE).to(device)
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
        )
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
        """The progress record; staleness (inner steps between a microbatch's start and its landing, the dropped
        included) over the microbatches landed since the last record."""
        elapsed = time.perf_counter() - started
        staleness, self.staleness = self.staleness, []
        return {
            "role": "trainer",
            "step": self.inner_steps,
            "tokens": self.tokens,
            "elapsed_s": elapsed,
            "train_loss": sum(losses) / len(losses) if losses else None,
            "tokens_per_s": self.tokens / max(elapsed, 1e-9),
            "lr": self.inner.lr,
            "grad_norm": self.inner.grad_norm,
            "window": self.window.size,
            "round_trip_s": self.window.round_trip_s,
            "microbatches_per_s": self.window.microbatches_per_s,
            "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
            "staleness_max": max(staleness, default=None),
            **self.counters,
            "wire_bytes": dict(self.traffic.sent + self.traffic.received),
            "fp32_bytes": dict(self.fp32_bytes),
            "frames_sent": dict(self.traffic.frames),  # by codec
            "links": self.codecs.report(),  # per peer: codecs chosen, bytes/s and compute per call measured
            "condemned": sorted(map(str, self.condemned)),  # servers a referee found wrong, banned now
        }

    def status(self) -> StageStatus:
        in_flight = self.counters["started"] - sum(self.counters[k] for k in ("completed", "failed", "cancelled"))
        # the servers it condemned: their stages' replicas leave their pseudo-gradients out of the round
        condemned = verdicts(self.remote.checker.condemned, now=time.monotonic(), dht_now=time.time())
        grad_norm = float(self.inner.grad_norm)
        return StageStatus(queue=in_flight, inner_steps=self.inner_steps, grad_norm=grad_norm, condemned=condemned)

    async def train_microbatch(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """One microbatch through the swarm and back; its loss, or None if it failed (counted)."""
        mb = Microbatch(self.remote.new_id(), (*inputs.shape, self.cfg.model.d_model), train=True)
        self.counters["started"] += 1
        try:
            path = self.router.draw_path(self.cfg.paths)
            self.counters["skipped_hops"] += path_length(self.cfg.stages.num_stages, self.cfg.paths) - len(path)
            # the steps of swarm/model/step.py, with an RPC per middle-stage hop
            h0, departure = await self._run(self._embed, inputs)  # (B, T, d), holds the embedding's graph
            hops, h = await self.remote.forward_path(mb, path, h0.detach(), inputs)
            loss, grad, head_grads = await self._run(self._head_gradients, h, targets)
            self.remote.checker.observe_loss(loss, [hop.peer for hop in hops])  # spikes make a path's servers suspect
            outgoing = Outgoing(grad, None)
            for hop in reversed(hops):
                outgoing = await self.remote.backward_hop(mb, hop, outgoing)
            grad = outgoing.value
            staleness = await self._run(self._land, departure, h0, grad, head_grads)
        except asyncio.CancelledError:
            self.counters["cancelled"] += 1
            raise
        except Exception as e:  # HopFailed, or a bug: either way counted and said, never silent
            self.counters["failed"] += 1
            logger.warning(f"microbatch {mb.id} failed: {e}", exc_info=not isinstance(e, HopFailed))
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
            mb = Microbatch(self.remote.new_id("eval"), (*inputs.shape, self.cfg.model.d_model), train=False)
            h0 = await self._run(self._embed_eval, inputs)
            _, h = await self.remote.forward_path(mb, sorted(self.router.live_stages()), h0, inputs)
            total += await self._run(self._head_eval, h, targets) * inputs.shape[0]
            count += inputs.shape[0]
        return total / count

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # torch work, on the single edge thread (serialised with the inner step)

    def _precision(self) -> AbstractContextManager[None]:
        return compute_precision(self.device, self.cfg.train.precision)

    def _embed(self, inputs: torch.Tensor) -> tuple[torch.Tensor, Departure]:
        # stamped here, on the edge thread: with the weights epoch and inner step the embedding ran at
        departure = Departure(
            inner_steps=self.inner_steps,
            weights=self._weights_epoch,
            at=time.perf_counter(),
            delivered=self.window.delivered,
        )
        with self._precision():
            return embed(self.edge, inputs.to(self.device)), departure

    @torch.no_grad()
    def _embed_eval(self, inputs: torch.Tensor) -> torch.Tensor:
        with self._precision():
            h: torch.Tensor = self.edge.embed(inputs.to(self.device))
        return h

    def _head_gradients(self, h: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor, Gradients]:
        # held apart until the microbatch lands: an inner step taken meanwhile must not get half of its gradients
        with self._precision():
            return head_gradients(
                self.edge, h.to(self.device), targets.to(self.device), inner_batch=self.cfg.train.inner_batch
            )

    @torch.no_grad()
    def _head_eval(self, h: torch.Tensor, targets: torch.Tensor) -> float:
        with self._precision():
            return loss_fn(self.edge.head(h.to(self.device)), targets.to(self.device)).item()

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
        add_gradients(self.edge, head_grads)
        with self._precision():
            embed_backward(h0, grad.to(self.device))
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
        """Servers whose checked work a referee found wrong (banned now): the outer step leaves their pseudo-gradients
        out of the round."""
        return self.remote.checker.condemned_now()

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
