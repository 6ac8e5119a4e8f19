"""The middle stages as a trainer reaches them (``RemoteStages``): a replica per hop, each frame coded for its link,
a failed call retried on another replica (a lost forward input resent), every call's deadline from its server's
service times, its bytes metered, and the servers' work audited (``HopAudit``: checks and probes).

    >>> stages = RemoteStages(cfg, calls, router, options, codecs=codecs, counters=c, traffic=t, fp32_bytes=f)
    >>> hops, h = await stages.forward_path(Microbatch("mb0", (8, 1024, 768), train=True), [1, 2], h0, tokens)
    >>> grad = await stages.backward_hop(mb, hops[-1], Outgoing(dh, None))
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from compress.codec_base import BOUNDARY_MAX_ABS, Codec
from compress.errors import WireError
from swarm.config import SwarmConfig, TrainerOptions
from swarm.dht.metrics import Traffic
from swarm.hardware import CPU
from swarm.model.stages import EDGE_STAGE
from swarm.pipeline.audit import HopAudit, LossOf
from swarm.pipeline.deadlines import DeadlineRule, Deadlines
from swarm.pipeline.frames import Encoder, Hop, LinkCodecs, Microbatch, Outgoing
from swarm.pipeline.protocol import KEEPALIVE_S, Backward, Forward, needs_stream
from swarm.pipeline.relay import MISSING_INPUT
from swarm.pipeline.routing import NoLiveReplica, Peer, Router
from swarm.rpc.servicer import DIAL_BACKOFF_S, RemoteError, RequestError, dial_backed_off

logger = logging.getLogger(__name__)


class StageCalls(Protocol):
    """Each call returns the reply frame; a ``Reply`` (``StageClient``'s, ``StageServer``'s) also carries the server's
    timings, which measure the link: a link answered in plain bytes stays unmeasured."""

    async def forward(self, peer: Peer, request: Forward, *, timeout: float) -> bytes: ...

    async def backward(self, peer: Peer, request: Backward, *, timeout: float) -> bytes: ...


class HopFailed(Exception):
    """Every replica tried for a hop failed, or none is live."""


class CacheMiss(Exception):
    """The server no longer holds the microbatch's forward input."""


class MissingInput(Exception):
    """A call by reference found no delivered input (or not the frame committed): relaying.py falls back."""


class RemoteStages:
    """The middle stages as a trainer reaches them: a replica chosen per hop, each frame coded for its link, a failed
    call retried on another replica (a lost forward input resent), and the router, the link estimates and the
    trainer's counters and traffic told how every call went. Each call's deadline follows its server's service times
    (``Deadlines``); a sampled fraction of training forwards is recomputed by another replica, off the microbatch's
    critical path and judged by the loss it gives (``loss_of``: the trainer's head), and a server whose work fails is
    condemned and routed around (``HopAudit``)."""

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
        loss_of: LossOf | None = None,
        encode: Encoder | None = None,
    ) -> None:
        self.cfg, self.calls, self.router, self.options = cfg, calls, router, options
        self.encode = encode  # of the trainer's own tensors (None: each codec's; a paced trainer's: pacing.py)
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
        self.audit = HopAudit(
            self, router, options, counters=counters, loss_of=loss_of
        )  # checks and probes of the servers' work
        self._ids = itertools.count()  # microbatch ids: a probe's forwards look like any microbatch's

    def new_id(self) -> str:
        """The next microbatch id on the wire, one sequence for every forward this trainer sends (training,
        validation, a check's recompute or continuation, a probe): a server that could tell a check from ordinary
        work by its id could answer checks honestly and lie otherwise."""
        return f"mb{next(self._ids)}"

    async def forward_path(
        self, mb: Microbatch, path: list[int], h0: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[list[Hop], torch.Tensor]:
        """The hops taken and the decoded output of the last one (``h0`` itself if none was)."""
        hops, prev, outgoing = [], EDGE_STAGE, Outgoing(h0, tokens, encode=self.encode)
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
            peer = self.choose(stage, tried)
            tried.append(peer)
            codec = self.codecs.choose("activations", peer, mb.shape)
            frame = x.frame(codec)
            request = Forward(mb=mb.id, stage=stage, prev_stage=prev, x=frame, train=mb.train)
            if (reply := await self.call(mb, peer, request, codec.name)) is not None:
                if await self.audit.forward(mb, request, codec.name, peer, out := Outgoing(*reply)):
                    weights = getattr(reply[2], "weights", None)  # (``Reply.weights``): a backward probe asks for them
                    return Hop(stage, peer, frame, codec.name, prev, weights), out
                # condemned by its check: this hop again, on another replica
        raise HopFailed(f"stage {stage}: {len(tried)} replicas failed")

    async def close(self) -> None:
        """Cancel the audits under way."""
        await self.audit.close()

    async def backward_path(self, mb: Microbatch, hops: list[Hop], grad: Outgoing) -> Outgoing:
        """The gradient of the first hop's input, back along ``hops`` (``HopFailed`` if a hop's cannot be had)."""
        for hop in reversed(hops):
            grad = await self.backward_hop(mb, hop, grad)
        return grad

    async def backward_hop(self, mb: Microbatch, hop: Hop, grad: Outgoing, *, elsewhere: bool = False) -> Outgoing:
        """Gradient w.r.t. the hop's input: from its server, else from any replica given the input again. The one that
        answered may have it probed (``HopAudit.backward``): off the path once it passed its first probes, else before
        it lands (a failed or unjudged one is redone on another replica; unjudged, it lands when none is left).
        ``elsewhere``: its server answered already (a relayed backward whose probe failed): another replica only."""
        peer, tried, resend = hop.peer, [hop.peer], False
        if elsewhere:
            if (other := self.other_replica(hop.stage, tried)) is None:
                raise HopFailed(f"backward of stage {hop.stage}: no other replica")
            peer, resend = other, True
            tried.append(peer)
        unjudged: Outgoing | None = None  # the last reply whose probe could not judge it
        for _ in range(self.options.max_attempts):
            self.counters["resent_inputs"] += resend
            codec = self.codecs.choose("gradients", peer, mb.shape)
            request = Backward(mb=mb.id, stage=hop.stage, grad=grad.frame(codec), x=hop.x if resend else None)
            try:
                reply = await self.call(mb, peer, request, codec.name, hop.x_codec)
            except CacheMiss:  # the server dropped the input: resend it, to the same server
                resend = True
                continue
            if reply is not None:
                outcome = await self.audit.backward(mb, hop, peer, grad.value, reply[0])
                if outcome == "passed":
                    return Outgoing(*reply)
                if outcome == "unjudged":
                    unjudged = Outgoing(*reply)
            resend = True  # another replica never saw this microbatch (or the last one's gradient failed its probe)
            if (other := self.other_replica(hop.stage, tried)) is None:
                if unjudged is not None:
                    return unjudged
                raise HopFailed(f"backward of stage {hop.stage}: no replica left after {len(tried)}")
            peer = other
            tried.append(peer)
        if unjudged is not None:
            return unjudged
        raise HopFailed(f"backward of stage {hop.stage}: {len(tried)} attempts failed")

    def other_replica(self, stage: int, tried: list[Peer]) -> Peer | None:
        """A replica of ``stage`` not in ``tried`` (``choose``), or None if none is left."""
        try:
            return self.choose(stage, tried)
        except HopFailed:
            return None

    def has_other_replica(self, stage: int, tried: list[Peer]) -> bool:
        """Whether ``choose`` would find a replica of ``stage`` not in ``tried``, asked without choosing it."""
        exclude = set(tried) | self.audit.excluded_now()
        return any(peer not in exclude for peer in self.router.live_peers(stage))

    def choose(self, stage: int, tried: list[Peer]) -> Peer:
        """A replica of ``stage`` not in ``tried``, not condemned (its router ban may have ended with a DHT re-listing,
        which forgets bans) and not resting as unfit (``HopAudit.excluded_now``)."""
        exclude = set(tried) | self.audit.excluded_now()
        try:
            return self.router.choose(stage, task_size=self.cfg.train.microbatch_size, exclude=exclude)
        except NoLiveReplica as e:
            raise HopFailed(f"stage {stage}: {e}") from None

    async def call(
        self, mb: Microbatch, peer: Peer, request: Forward | Backward, codec: str, x_codec: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, bytes, Codec] | None:
        """One RPC, with the router and the link estimate told how it went: the reply (decoded, its token ids, the
        frame, its codec), or None to move on. ``codec``: the request's frame's; ``x_codec``: a resent input's."""
        got = await self.exchange(mb, peer, request, codec, x_codec)
        return None if got is None or got[1] is None else (got[1][1], got[1][2], got[0], got[1][0])

    async def exchange(
        self, mb: Microbatch, peer: Peer, request: Forward | Backward, codec: str, x_codec: str | None = None
    ) -> tuple[bytes, tuple[Codec, torch.Tensor, torch.Tensor | None] | None] | None:
        """``call``'s RPC: the reply and its decoding, None for a relayed reply (``Reply.sent``: its frame went on to
        the next server); None to move on. ``MissingInput``: a call by reference whose input is not there."""
        stage, started = request.stage, time.perf_counter()
        if isinstance(request, Forward):
            kind, frame, resent = "activations", request.x, None
        else:
            kind, frame, resent = "gradients", request.grad, request.x
        # a forward not kept (validation, a check's recompute or continuation, a probe) is "eval" traffic, as its
        # server meters it (metering.py): the per-token costs of training are of the forwards that train
        counted = "eval" if isinstance(request, Forward) and not request.train else kind
        sent = self._count(mb, counted, frame, sent=True, codec=codec)
        if resent is not None:
            sent += self._count(mb, "activations", resent, sent=True, codec=x_codec)
        timeout = self._deadline(peer, request, sent)
        try:
            out = await self._send(peer, request, timeout)
            wire_and_server_s = time.perf_counter() - started  # the link's measure: our decode below is no part of it
            received = self._count(mb, counted, out, sent=False)
            # a bad reply is this server's fault, not the next hop's; one of another shape is refused from its header
            relayed = getattr(out, "sent", None) is not None
            decoded = None if relayed else await self.decode(kind, out, mb.shape)
        except TimeoutError:
            self._missed(stage, peer, timeout)
            return None
        except RemoteError as e:
            self._refused(stage, peer, e, time.perf_counter() - started)
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
        return out, decoded

    def _refused(self, stage: int, peer: Peer, e: RemoteError, seconds: float) -> None:
        """A call that came back refused (or never got through) after ``seconds``: told to the router and counted;
        ``CacheMiss`` and ``MissingInput`` for the caller to act on."""
        if e.code == RequestError.CACHE_MISS:
            raise CacheMiss(str(e)) from None
        if e.code == MISSING_INPUT:
            self.counters["relay_missing_input"] += 1
            raise MissingInput(str(e)) from None
        if e.code == RequestError.GONE:  # a probe's weights are gone: no one's fault, no failed hop (audit.py)
            self.counters["probes_weights_gone"] += 1
            return
        if dial_backed_off(e):
            # this trainer's daemon would not dial yet (an earlier dial failed, one before the server listened,
            # say): around it until the backoff ends, no failure counted (a first call that met it banned the
            # server for 15 s and 10 hops of a WAN-lab run went around its stage, docs/benchmarks.md)
            self.counters["hop_dial_backoff"] += 1
            self.router.ban(stage, peer, DIAL_BACKOFF_S, reason=str(e))
            logger.info(f"stage {stage} peer {peer}: {e}")
            return
        self.counters["hop_failures" if e.code == RequestError.UNREACHABLE else f"hop_refused_{e.code}"] += 1
        # busy: alive but loaded; invalid: it refused what this trainer sent (a gradient its screen would not
        # take, a frame it could not read): this trainer's fault, not the server's. Either way charge it the
        # time (a server refusing everything falls behind in the routing) but do not ban it.
        if e.code in (RequestError.BUSY, RequestError.INVALID):
            self.router.report_timeout(stage, peer, seconds, reason=str(e))
        else:
            self.router.report_failure(stage, peer, reason=str(e))
        logger.info(f"stage {stage} peer {peer}: {e}")

    async def decode(
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
        same tensor would cost uncompressed. Returns the frame's bytes. A frame sent by reference or sent on by its
        server (relaying.py: b"") crossed another link, not this one."""
        if not frame:
            return 0
        kind = kind if mb.train else "eval"  # validation traffic apart: per-token costs are of training
        (self.traffic.sent if sent else self.traffic.received)[kind] += len(frame)
        self.fp32_bytes[kind] += 4 * math.prod(mb.shape)
        if codec is not None:
            self.traffic.frames[codec] += 1
        return len(frame)
