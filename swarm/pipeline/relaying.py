"""Frames sent server to server, the trainer's side (``TrainerOptions.relay``, ``--relay``): the trainer keeps the
control of every hop and the path's ends, the frames in between go server to server.

Forward: the trainer sends the embedding to the first server naming the next hop (``Forward.deliver_to``); a server
pushes its output there (relay_rpc.py) and replies with the frame's digest only (``Reply.sent``); the trainer calls the
next server by reference (``x_from``, ``x_digest``), and the last server replies with its output as today. Backward
mirrors it, the first hop's input gradient coming back to the trainer (it trains the embedding). The trainer's link
carries the path's two ends instead of 2·S frames a way.

Whatever goes wrong with a relayed frame (a push that failed, a delivery missing or not the frame committed, a hop
that failed, a check or probe that failed) falls back to today's path for that hop (hops.py's ``forward_hop`` /
``backward_hop``: other replicas, skips, resent inputs, ``HopFailed``), with the frame fetched by digest from the
server that sent it on, or the one that took it (relay.py's ``Outbox``); a forward input nobody holds any more sends
the microbatch down today's path from its embedding. Checks and probes (audit.py) are taken once a hop answered, and
fetch the committed frames by digest: checked and unchecked hops look the same on the wire.

    >>> relayed = RelayedHops(stages, client)  # client: a RelayClient (fetch)
    >>> hops, h = await relayed.forward_path(mb, path, h0, tokens); grad = await relayed.backward_path(mb, hops, dh)
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from swarm.model.stages import EDGE_STAGE
from swarm.pipeline.audit import ProbeOutcome
from swarm.pipeline.frames import Hop, Microbatch, Outgoing
from swarm.pipeline.hops import CacheMiss, HopFailed, MissingInput, RemoteStages
from swarm.pipeline.protocol import REPLY_SLACK_BYTES, Backward, Forward, Sent
from swarm.pipeline.relay import Fetch, digest
from swarm.pipeline.routing import Peer
from swarm.rpc.servicer import RemoteError

logger = logging.getLogger(__name__)


class Fetcher(Protocol):
    """Fetches a frame by digest from a server (``RelayClient``)."""

    async def fetch(self, peer: Peer, request: Fetch, *, timeout: float, max_bytes: int) -> bytes: ...


@dataclass(frozen=True)
class Ref:
    """A frame the trainer does not hold: committed by ``sender`` (which keeps it) and delivered to ``receiver``
    (None: the delivery failed), in codec ``codec``."""

    sender: Peer
    receiver: Peer | None
    digest: bytes
    raw_bytes: int
    codec: str


@dataclass(frozen=True)
class RelayedHop:
    hop: Hop  # its ``x`` is b"" when its input came by reference (``x_ref``)
    x_ref: Ref | None = None


class RelayedHops:
    """A microbatch's hops with its frames sent server to server, over a trainer's ``RemoteStages`` (its replica
    choice, deadlines, metering, link codecs and audit)."""

    def __init__(self, stages: RemoteStages, fetcher: Fetcher) -> None:
        self.stages, self.fetcher, self.counters = stages, fetcher, stages.counters
        self.timeout_s = stages.cfg.timeouts.rpc_s

    async def forward_path(
        self, mb: Microbatch, path: list[int], h0: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[list[RelayedHop], torch.Tensor]:
        """As ``RemoteStages.forward_path``: the hops taken and the last one's decoded output."""
        chosen = self._choose(path)
        hops: list[RelayedHop] = []
        held: Outgoing | None = Outgoing(h0, tokens)
        ref: Ref | None = None
        prev = EDGE_STAGE
        for i, (stage, peer) in enumerate(chosen):
            after = chosen[i + 1][1] if i + 1 < len(chosen) else None
            if ref is not None and ref.receiver is None:  # its push failed: the trainer sends it on
                self.counters["relay_undelivered"] += 1
                held, ref = await self._materialize(mb, ref, "activations"), None
            if held is None and ref is None:  # a forward input nobody holds any more: today's path from the embedding
                return await self._from_scratch(mb, path, h0, tokens)
            got = await self._forward(mb, stage, prev, peer, after, held, ref)
            if got is None:  # today's path for this hop, its input in hand
                self.counters["relay_fallbacks"] += 1
                if ref is not None:
                    held, ref = await self._materialize(mb, ref, "activations"), None
                if held is None:
                    return await self._from_scratch(mb, path, h0, tokens)
                try:
                    hop, held = await self.stages.forward_hop(mb, stage, prev, held)
                except HopFailed as e:
                    self.counters["skipped_hops"] += 1
                    logger.warning(f"{mb.id}: skipping stage {stage}: {e}")
                    continue
                hops.append(RelayedHop(hop))
            else:
                hop_taken, held, ref = got
                hops.append(hop_taken)
            prev = stage
        if ref is not None:  # the last hop sent its output on after all (never by design): fetch it
            held = await self._materialize(mb, ref, "activations")
        if held is None:
            return await self._from_scratch(mb, path, h0, tokens)
        return hops, held.value

    async def backward_path(self, mb: Microbatch, hops: list[RelayedHop], grad: Outgoing) -> Outgoing:
        """The gradient of the first hop's input, back along ``hops`` (``HopFailed`` if it cannot be had)."""
        held: Outgoing | None = grad
        ref: Ref | None = None
        for j in reversed(range(len(hops))):
            to = hops[j - 1].hop.peer if j > 0 else None
            got = None if ref is not None and ref.receiver is None else await self._backward(mb, hops[j], to, held, ref)
            if got is None or isinstance(got, str):  # today's path for this hop, its gradient and input in hand
                self.counters["relay_fallbacks"] += 1
                if ref is not None:
                    held, ref = await self._materialize(mb, ref, "gradients"), None
                hop = await self._with_input(mb, hops[j])
                if held is None or hop is None:
                    raise HopFailed(f"backward of stage {hops[j].hop.stage}: a relayed frame is held nowhere")
                held = await self.stages.backward_hop(mb, hop, held, elsewhere=got == "elsewhere")
            else:
                held, ref = got
        if ref is not None:
            held = await self._materialize(mb, ref, "gradients")
        if held is None:
            raise HopFailed("the first hop's input gradient is held nowhere")
        return held

    def _choose(self, path: list[int]) -> list[tuple[int, Peer]]:
        """A replica per stage of ``path``, chosen before the first call (each hop names the next); a stage with none
        live is skipped, as ``forward_path`` skips it."""
        chosen = []
        for stage in path:
            try:
                chosen.append((stage, self.stages.choose(stage, [])))
            except HopFailed as e:
                self.counters["skipped_hops"] += 1
                logger.warning(f"skipping stage {stage}: {e}")
        return chosen

    async def _forward(
        self,
        mb: Microbatch,
        stage: int,
        prev: int,
        peer: Peer,
        after: Peer | None,
        held: Outgoing | None,
        ref: Ref | None,
    ) -> tuple[RelayedHop, Outgoing | None, Ref | None] | None:
        """One relayed forward: the hop, and its output in hand (the last hop) or by reference; None to fall back."""
        deliver_to = None if after is None else str(after)
        if ref is None:
            assert held is not None
            codec = self.stages.codecs.choose("activations", peer, mb.shape)
            codec_name, frame = codec.name, held.frame(codec)
            request = Forward(mb=mb.id, stage=stage, prev_stage=prev, x=frame, train=mb.train, deliver_to=deliver_to)
        else:
            codec_name, frame = ref.codec, b""
            request = Forward(
                mb=mb.id,
                stage=stage,
                prev_stage=prev,
                x=b"",
                train=mb.train,
                x_from=str(ref.sender),
                x_digest=ref.digest,
                ref_bytes=ref.raw_bytes,
                deliver_to=deliver_to,
            )
        try:
            got = await self.stages.exchange(mb, peer, request, codec_name)
        except MissingInput as e:
            logger.info(f"{mb.id}: stage {stage} at {peer}: {e}")
            return None
        if got is None:
            return None
        out, decoded = got
        sent: Sent | None = getattr(out, "sent", None)
        y: Outgoing | None = None
        y_ref: Ref | None = None
        if decoded is not None:
            y = Outgoing(decoded[1], decoded[2], out, decoded[0])
        elif sent is not None and after is not None:
            y_ref = Ref(peer, after if sent.delivered else None, sent.digest, sent.raw_bytes, codec_name)
        else:
            return None
        hop = RelayedHop(Hop(stage, peer, frame, codec_name, prev, getattr(out, "weights", None)), ref)
        if not await self._check(mb, request, codec_name, peer, hop, y, y_ref):
            return None  # its check failed: this hop again, elsewhere
        return hop, y, y_ref

    async def _check(
        self,
        mb: Microbatch,
        request: Forward,
        codec: str,
        peer: Peer,
        hop: RelayedHop,
        y: Outgoing | None,
        y_ref: Ref | None,
    ) -> bool:
        """The audit's check of a relayed forward, on its frames fetched by digest (``HopAudit.check``). With no other
        replica to recompute it the check could only leave it unchecked (``HopAudit``'s compare finds none), so no
        frame is fetched for it: in the WAN lab, one server a stage, every forward of a server not yet proven was
        fetched whole for a check that never ran (2.2 frames a microbatch over the trainer's link)."""
        if not self.stages.has_other_replica(request.stage, [peer]):
            return True
        plan = self.stages.audit.check_plan(mb, peer)

        async def check() -> bool:
            with_x = await self._with_input(mb, hop)
            out = y if y is not None or y_ref is None else await self._materialize(mb, y_ref, "activations")
            if with_x is None or out is None:  # a server that will not show what it committed is not checked
                self.counters["relay_unaudited"] += 1
                return False
            full = dataclasses.replace(request, x=with_x.x, x_from=None, x_digest=None, ref_bytes=0, deliver_to=None)
            return await self.stages.audit.check(mb, full, codec, peer, out)

        return await self.stages.audit.checked(plan, check)

    async def _backward(
        self, mb: Microbatch, relayed: RelayedHop, to: Peer | None, held: Outgoing | None, ref: Ref | None
    ) -> tuple[Outgoing | None, Ref | None] | str | None:
        """One relayed backward: the input gradient in hand (the first hop) or by reference; None to fall back,
        "elsewhere" to fall back to another replica (its probe failed)."""
        hop, deliver_to = relayed.hop, None if to is None else str(to)
        if ref is None:
            assert held is not None
            codec = self.stages.codecs.choose("gradients", hop.peer, mb.shape)
            codec_name, frame = codec.name, held.frame(codec)
            request = Backward(mb=mb.id, stage=hop.stage, grad=frame, deliver_to=deliver_to)
        else:
            codec_name, frame = ref.codec, b""
            request = Backward(
                mb=mb.id,
                stage=hop.stage,
                grad=b"",
                grad_from=str(ref.sender),
                grad_digest=ref.digest,
                ref_bytes=ref.raw_bytes,
                deliver_to=deliver_to,
            )
        try:
            got = await self.stages.exchange(mb, hop.peer, request, codec_name)
        except (MissingInput, CacheMiss) as e:  # the resent input is today's path's: fall back
            logger.info(f"{mb.id}: backward of stage {hop.stage} at {hop.peer}: {e}")
            return None
        if got is None:
            return None
        out, decoded = got
        sent: Sent | None = getattr(out, "sent", None)
        g: Outgoing | None = None
        g_ref: Ref | None = None
        if decoded is not None:
            g = Outgoing(decoded[1], None, out, decoded[0])
        elif sent is not None and to is not None:
            g_ref = Ref(hop.peer, to if sent.delivered else None, sent.digest, sent.raw_bytes, codec_name)
        else:
            return None
        outcome = await self._probe(mb, relayed, (held, ref), (g, g_ref))
        if outcome == "passed":
            return g, g_ref
        return "elsewhere"

    async def _probe(
        self,
        mb: Microbatch,
        relayed: RelayedHop,
        given: tuple[Outgoing | None, Ref | None],
        returned: tuple[Outgoing | None, Ref | None],
    ) -> ProbeOutcome:
        """The audit's probe of a relayed backward, on its frames fetched by digest (``HopAudit.probe``)."""
        peer = relayed.hop.peer
        plan = self.stages.audit.probe_plan(mb, peer)

        async def probe() -> ProbeOutcome:
            u = given[0] if given[1] is None else await self._materialize(mb, given[1], "gradients")
            g = returned[0] if returned[1] is None else await self._materialize(mb, returned[1], "gradients")
            hop = await self._with_input(mb, relayed)
            if u is None or g is None or hop is None:
                self.counters["relay_unaudited"] += 1
                return "unjudged"
            return await self.stages.audit.probe(mb, hop, peer, u.value, g.value)

        return await self.stages.audit.probed(plan, probe)

    async def _with_input(self, mb: Microbatch, relayed: RelayedHop) -> Hop | None:
        """The hop with its input frame in hand (fetched by digest if it came by reference); None if none is held."""
        if relayed.x_ref is None:
            return relayed.hop
        frame = await self._fetch(mb, relayed.x_ref, "activations")
        return None if frame is None else dataclasses.replace(relayed.hop, x=frame)

    async def _materialize(self, mb: Microbatch, ref: Ref, kind: str) -> Outgoing | None:
        """The referenced frame, fetched and decoded (None if no server holds it, or it does not decode)."""
        if (frame := await self._fetch(mb, ref, kind)) is None:
            return None
        try:
            codec, value, tokens = await self.stages.decode(kind, frame, mb.shape)
        except Exception as e:  # its server committed a frame that does not decode: held nowhere usable
            logger.info(f"{mb.id}: fetched {kind} from {ref.sender} do not decode: {e}")
            return None
        return Outgoing(value, tokens, frame, codec)

    async def _fetch(self, mb: Microbatch, ref: Ref, kind: str) -> bytes | None:
        """The frame of ``ref``'s digest from its sender, else its receiver; verified, counted into the traffic."""
        for peer in (ref.sender, ref.receiver):
            if peer is None:
                continue
            try:
                request = Fetch(mb=mb.id, digest=ref.digest)
                frame = await self.fetcher.fetch(
                    peer, request, timeout=self.timeout_s, max_bytes=ref.raw_bytes + REPLY_SLACK_BYTES
                )
            except (RemoteError, TimeoutError) as e:
                logger.info(f"{mb.id}: fetch of {kind} from {peer}: {e}")
                continue
            self.stages.traffic.received[kind if mb.train else "eval"] += len(frame)
            if digest(frame) == ref.digest:
                self.counters["relay_fetches"] += 1
                return frame
            logger.warning(f"{mb.id}: {peer} answered a fetch with a frame of another digest")
        return None

    async def _from_scratch(
        self, mb: Microbatch, path: list[int], h0: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[list[RelayedHop], torch.Tensor]:
        """Today's path from the embedding: a relayed input was lost with every server that held it."""
        self.counters["relay_restarts"] += 1
        hops, h = await self.stages.forward_path(mb, path, h0, tokens)
        return [RelayedHop(hop) for hop in hops], h
