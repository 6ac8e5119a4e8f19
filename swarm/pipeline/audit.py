"""The trainer's audit of the work its servers return: forward hops checked against another replica and judged by
the loss each output gives down the rest of the path (checking.py), backwards probed through the same server's own
forwards (probing.py). Outputs worse than no work make a server unfit: routed around until it syncs (``rest``);
work that contradicts itself (a failed probe) condemns it: banned, and named in the trainer's record (``condemn``).

A new or suspect server's work lands only once its check or probe passed (``forward``/``backward`` wait for it); a
proven server's is audited off the microbatch's critical path, as a side job (``close`` cancels those). The calls
themselves go through the trainer's ``RemoteStages`` (``HopCalls``): one place for deadlines, metering and codecs.

    >>> audit = HopAudit(stages, router, options, counters=counters)  # RemoteStages builds its own
    >>> if not await audit.forward(mb, request, codec, peer, y): ...  # condemned: the hop again, elsewhere
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Literal, Protocol

import torch

from compress.codec_base import Codec
from swarm.config import TrainerOptions
from swarm.pipeline.checking import CheckRule, HopChecker
from swarm.pipeline.frames import Hop, LinkCodecs, Microbatch, Outgoing
from swarm.pipeline.probing import PROBED_CODECS, BackwardProbes, ProbeRule, descent, passes, probe_steps, resolved
from swarm.pipeline.protocol import Forward
from swarm.pipeline.routing import Peer, Router

logger = logging.getLogger(__name__)
# how long a server whose output failed its check (not harmfully: no worse than its stage skipped) leaves this
# trainer's routing: long next to a forward, short next to a run (the 60-step tests run ~5 s)
FAILED_OUTPUT_BAN_S = 2.0
Reply = tuple[torch.Tensor, torch.Tensor | None, bytes, Codec]  # decoded value, token ids, the frame, its codec
# what a backward's probe found: its gradient confirmed, contradicted, or not judged (no answer, the weights it was
# taken on gone, the replies' rounding); a backward that needs no probe is "passed"
ProbeOutcome = Literal["passed", "failed", "unjudged"]
Plan = Literal["side", "wait"] | None  # an audit not taken, taken off the microbatch's path, or waited for
# the trainer's loss for a microbatch's last boundary output h (B, T, d): its head, against ``mb.targets``
LossOf = Callable[[Microbatch, torch.Tensor], Awaitable[float]]


class HopCalls(Protocol):
    """What an audit calls servers through (``RemoteStages``)."""

    codecs: LinkCodecs

    def new_id(self) -> str: ...

    def other_replica(self, stage: int, tried: list[Peer]) -> Peer | None: ...

    async def call(self, mb: Microbatch, peer: Peer, request: Forward, codec: str) -> Reply | None: ...

    async def decode(
        self, kind: str, frame: bytes, shape: tuple[int, ...]
    ) -> tuple[Codec, torch.Tensor, torch.Tensor | None]: ...


class HopAudit:
    """Checks and probes of one trainer's hops, their verdicts (``checker.condemned``), and the side jobs under way."""

    def __init__(
        self,
        calls: HopCalls,
        router: Router,
        options: TrainerOptions,
        *,
        counters: Counter[str],
        loss_of: LossOf | None = None,
    ) -> None:
        self.calls, self.router, self.counters, self.loss_of = calls, router, counters, loss_of
        rate = options.check_rate  # 0: off, probation and suspects included (the cost measurement's baseline)
        rule = (
            CheckRule(rate=rate) if rate else CheckRule(rate=0.0, first_checks=0, probation_rate=0.0, suspect_rate=0.0)
        )
        self.checker = HopChecker(rule)
        probe_rate = options.probe_rate
        self.probes = BackwardProbes(ProbeRule(rate=probe_rate) if probe_rate else ProbeRule(rate=0.0, first_probes=0))
        self._jobs: set[asyncio.Task[Any]] = set()  # audits under way, off the microbatches' paths

    async def forward(self, mb: Microbatch, request: Forward, codec: str, peer: Peer, y: Outgoing) -> bool:
        """A forward ``peer`` answered with ``y``: whether it may land (False: it failed its check, so the hop goes to
        another replica). Sampled training forwards are checked; a new or suspect server's only lands once its check
        passed. Every validation forward is checked before it counts: a server tells a training forward from one not
        kept, and one lying on every forward not kept (as ``swarmtest.attacks.garble`` does) read out a val loss 1.3×
        the true one through forwards checked at the sampled rate. It cannot tell a validation forward from a check's
        recompute (one id sequence), so such a server also fails as a checker. A microbatch with no targets (nothing
        to judge a loss by) is not checked."""
        return await self.checked(self.check_plan(mb, peer), lambda: self.check(mb, request, codec, peer, y))

    def check_plan(self, mb: Microbatch, peer: Peer) -> Plan:
        """Whether a forward of ``peer`` is checked: not (None), off the path ("side") or before it lands ("wait").
        Taken once the forward was answered: a relayed forward's frames are fetched by digest only for a check."""
        if mb.targets is None or self.checker.off:
            return None
        if not mb.train:
            return "wait"
        if not self.checker.should_check(peer):
            return None
        return "wait" if self.checker.unproven(peer) else "side"

    async def checked(self, plan: Plan, check: Callable[[], Awaitable[bool]]) -> bool:
        """``check()`` as ``plan`` says (``check_plan``): whether the forward may land."""
        if plan is None:
            return True
        if plan == "side":
            self._side_job(check())
            return True
        return await check()

    async def backward(
        self, mb: Microbatch, hop: Hop, peer: Peer, grad: torch.Tensor, returned: torch.Tensor
    ) -> ProbeOutcome:
        """``peer`` answered the backward of ``hop`` given output gradient ``grad`` with ``returned``: whether it may
        land ("passed"), or its probe failed or could not judge it (the backward goes to another replica if there is
        one: a server that dodges its probes never proves itself). Sampled ones are probed off the path once the
        server passed its first probes (then "passed" at once), else before they land."""
        return await self.probed(self.probe_plan(mb, peer), lambda: self.probe(mb, hop, peer, grad, returned))

    def probe_plan(self, mb: Microbatch, peer: Peer) -> Plan:
        """Whether a backward of ``peer`` is probed: not (None), off the path ("side") or before it lands ("wait")."""
        if not mb.train or not self.probes.should_probe(peer) or not self._probeable(peer, mb.shape):
            return None
        return "side" if not self.probes.unproven(peer) else "wait"

    async def probed(self, plan: Plan, probe: Callable[[], Awaitable[ProbeOutcome]]) -> ProbeOutcome:
        """``probe()`` as ``plan`` says (``probe_plan``)."""
        if plan is None:
            return "passed"
        if plan == "side":
            self._side_job(probe())
            return "passed"
        return await probe()

    def observe_loss(self, loss: float, path: list[Peer]) -> None:
        """A training microbatch's loss through ``path``'s servers: spikes make a path's servers suspect."""
        self.checker.observe_loss(loss, path)

    def condemned_now(self) -> set[Hashable]:
        return self.checker.condemned_now()

    def excluded_now(self) -> set[Hashable]:
        """Servers no hop of this trainer goes to now: condemned, or unfit and not synced since (``rest``)."""
        return self.checker.condemned_now() | self.checker.unfit_now(self.router.outer_round)

    async def close(self) -> None:
        """Cancel the audits under way."""
        for task in list(self._jobs):
            task.cancel()
        await asyncio.gather(*self._jobs, return_exceptions=True)

    def _side_job(self, job: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(job)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)

    async def check(self, mb: Microbatch, request: Forward, codec: str, peer: Peer, y: Outgoing) -> bool:
        """The check of ``peer``'s forward (a caller that took ``check_plan`` itself calls it directly): the hop's
        forward again, on another replica; outputs apart judged by the loss each gives down the rest of
        the path (``HopChecker.by_loss``), the worse one's server failing. False if ``peer``'s failed."""
        stage = request.stage
        try:
            checker_peer, other, agreed = await self._compare(mb, request, codec, peer, y)
            if checker_peer is None or other is None:
                return True  # no other replica, or it failed, or only suspects agreed: unchecked
            if agreed:
                self.checker.clear(peer)
                self.checker.clear(checker_peer)
                return True
            self.counters["check_disagreements"] += 1
            losses = await losses_down_the_path(self.calls, self.loss_of, mb, stage, [y, other], prev=stage)
            if losses is None:  # the rest of the path failed, or no loss to judge by: both checked more
                logger.warning(f"stage {stage}: {peer} and {checker_peer} disagree on {mb.id}; no loss settled it")
                return self._unresolved(peer, checker_peer)
            worse = self.checker.by_loss(*losses)
            logger.debug(
                f"stage {stage}: {mb.id} judged by loss: {peer} {losses[0]:.4f}, {checker_peer} {losses[1]:.4f}"
            )
            if worse is None:
                if not self.checker.close_enough(y.value, other.value):
                    # no honest drift is this far, and the loss cannot yet tell (near chance, at the start): neither
                    # is cleared, both checked on every forward until it can. Cleared here, a garbler passed its
                    # first check at the start and then landed 98% of its forwards unchecked (+46% val)
                    return self._unresolved(peer, checker_peer)
                return await self._both_within_the_margin(mb, request, {peer: losses[0], checker_peer: losses[1]})
            wrong, right = (peer, checker_peer) if worse == 0 else (checker_peer, peer)
            loss_wrong, loss_right = (losses[0], losses[1]) if worse == 0 else (losses[1], losses[0])
            return await self._against_the_skip(mb, request, peer, (wrong, loss_wrong), (right, loss_right))
        except Exception as e:  # a check is a side job: it must never take the trainer down
            logger.warning(f"check of {mb.id} at stage {stage} failed: {type(e).__name__}: {e}")
            return True

    async def _skip_loss(self, mb: Microbatch, request: Forward) -> float | None:
        """The loss with the hop's stage skipped: its input sent on down the rest of the path (None: a call failed)."""
        _, x, tokens = await self.calls.decode("activations", request.x, mb.shape)
        skip = await losses_down_the_path(
            self.calls, self.loss_of, mb, request.stage, [Outgoing(x, tokens)], prev=request.prev_stage
        )
        return None if skip is None else skip[0]

    async def _both_within_the_margin(self, mb: Microbatch, request: Forward, losses: dict[Peer, float]) -> bool:
        """Outputs apart whose losses the margin cannot tell apart: both land, and each server is cleared only if its
        output beats the stage skipped (a server passing its input through gives the skip's loss, within the margin
        of an honest output while the stage barely beats skipping it, and cleared then it landed its forwards
        unchecked); one that does not is checked more."""
        if (skip := await self._skip_loss(mb, request)) is None:
            return self._unresolved(*losses)
        behind = [peer for peer, loss in losses.items() if self.checker.no_better_than_skipping(loss, skip)]
        for peer in losses.keys() - set(behind):
            self.checker.clear(peer, by_loss=True)
        if behind:
            return self._unresolved(*behind)
        return True

    async def _against_the_skip(
        self, mb: Microbatch, request: Forward, peer: Peer, worse: tuple[Peer, float], better: tuple[Peer, float]
    ) -> bool:
        """Outputs the loss told apart (``worse``, ``better``: server and loss) judged against the loss with the stage
        skipped: the worse fails only if it does no better than no work, and is harmful over ``harm_margin`` above it.
        False if ``peer``'s output failed."""
        stage, (wrong, loss_wrong), (right, loss_right) = request.stage, worse, better
        if (skip := await self._skip_loss(mb, request)) is None:
            return self._unresolved(wrong, right)
        # the better one proves itself only by beating its stage skipped: at the start, near chance, a garbler
        # "won" judgements by chance and, cleared, landed its forwards unchecked
        if self.checker.no_better_than_skipping(loss_right, skip):
            return self._unresolved(wrong, right)
        if not self.checker.no_better_than_skipping(loss_wrong, skip):  # it did the stage's work, less of it
            self.counters["checks_behind"] += 1
            self.checker.clear(right, by_loss=True)
            self.checker.suspect(wrong)  # checked more: it may be an attacker doing just enough
            logger.info(
                f"stage {stage}: {wrong}'s output of {mb.id} gave loss {loss_wrong:.4f} against {loss_right:.4f}"
                f" of {right}'s, yet better than skipping the stage ({skip:.4f}): behind, not wrong"
            )
            return True
        self.checker.clear(right, by_loss=True)
        self.counters["check_failures"] += 1
        harmful = self.checker.harmful(loss_wrong, skip)
        if not harmful:
            # out of the routing a while: a server passing its input through is the fastest there is, and charged
            # only the time its checks took it kept two thirds of the forwards (to have them redone elsewhere) and
            # starved the honest replicas until their stages did worse than skipped. A harmful one stays routed,
            # each forward checked and held as a suspect's, until it is found unfit (``rest``)
            self.router.ban(stage, wrong, FAILED_OUTPUT_BAN_S, reason=f"its output of {mb.id} failed its check")
        logger.warning(
            f"stage {stage}: {wrong}'s output of {mb.id} gave loss {loss_wrong:.4f} against {loss_right:.4f} of"
            f" {right}'s, no better than skipping the stage ({skip:.4f})"
        )
        if self.checker.failed(wrong, harmful=harmful):
            self.rest(stage, wrong)
        return wrong != peer

    def _unresolved(self, *peers: Peer) -> bool:
        """A check nothing settled: no one cleared, both checked on every forward; the reply lands (True)."""
        self.counters["checks_unresolved"] += 1
        self.checker.suspect(*peers)
        return True

    async def _compare(
        self, mb: Microbatch, request: Forward, codec: str, peer: Peer, y: Outgoing
    ) -> tuple[Peer | None, Outgoing | None, bool]:
        """Another replica's output for the hop's input, and whether it agrees with ``y``. A suspect that agrees vouches
        for nothing (two colluders agree with each other, and clearing each other they landed their outputs
        unchecked), so the next replica is asked, until one that is no suspect agrees or one disagrees; Nones if none
        is left or a recompute failed."""
        tried = [peer]
        while True:
            checker_peer, other = await self._recompute(mb, request, codec, tried)
            if checker_peer is None or other is None:
                return None, None, False
            self.counters["checks"] += 1
            if not self.checker.agree(y.value, other.value):
                return checker_peer, other, False
            if checker_peer not in self.checker.suspects:
                return checker_peer, other, True
            tried.append(checker_peer)

    async def _recompute(
        self, mb: Microbatch, request: Forward, codec: str, tried: list[Peer]
    ) -> tuple[Peer | None, Outgoing | None]:
        """Another replica's output for the same input (its forward not kept: ``train=False``), or Nones."""
        if (peer := self.calls.other_replica(request.stage, tried)) is None:
            return None, None
        again = Forward(
            mb=self.calls.new_id(),  # from the trainer's one sequence: no id tells a check from validation
            stage=request.stage,
            prev_stage=request.prev_stage,
            x=request.x,
            train=False,
        )
        reply = await self.calls.call(mb, peer, again, codec)
        return peer, None if reply is None else Outgoing(*reply)

    def _probeable(self, peer: Peer, shape: tuple[int, ...]) -> bool:
        """The link's codecs round finely enough for a probe to judge (``PROBED_CODECS``)."""
        codecs = self.calls.codecs
        return all(codecs.choose(kind, peer, shape).name in PROBED_CODECS for kind in ("activations", "gradients"))

    async def probe(self, mb: Microbatch, hop: Hop, peer: Peer, u: torch.Tensor, g: torch.Tensor) -> ProbeOutcome:
        """The probe of ``peer``'s backward of ``hop`` (a caller that took ``probe_plan`` itself calls it directly):
        two ordinary forwards of ``peer`` at x ± εg, on the weights its forward of ``hop`` ran on (``Hop.weights``,
        which its backward differentiated at), judge the gradient g it returned (probing.py)."""
        if hop.weights is None:  # the server did not say which weights its forward ran on (an older release)
            self.counters["probes_unanswered"] += 1
            return "unjudged"
        try:
            _, x, tokens = await self.calls.decode("activations", hop.x, mb.shape)
            eps = probe_steps(x, g, self.probes.step(peer))
            if (outputs := await probe_outputs(self.calls, mb, hop, peer, Outgoing(x, tokens), eps * g.to(x))) is None:
                self.counters["probes_unanswered"] += 1  # no answer, or the weights are gone: refused
                return "unjudged"
            if resolved(*outputs) < self.probes.rule.min_resolved:  # the reply's rounding swallowed the step
                self.counters["probes_unresolved"] += 1
                self.probes.unresolved(peer)
                return "unjudged"
            judged = descent(u.to(outputs[0].device), outputs[0], outputs[1], eps, g.to(outputs[0].device))
        except Exception as e:  # a probe is a side job: it must never take the trainer down
            logger.warning(f"probe of {mb.id} at stage {hop.stage} failed: {type(e).__name__}: {e}")
            return "unjudged"
        self.counters["probes"] += 1
        passed = passes(judged, self.probes.rule)
        self.counters["probe_failures"] += not passed
        if self.probes.record(peer, judged):
            self.condemn(hop.stage, peer, mb, why="its backward points against its own forward's gradient")
        elif not passed:
            logger.warning(f"stage {hop.stage}: {peer}'s backward of {mb.id} failed a probe (descent {judged:.3f})")
        return "passed" if passed else "failed"

    def rest(self, stage: int, peer: Peer) -> None:
        """``peer``'s outputs were worse than no work, harmfully often: out of this trainer's routing until its outer
        round moves on or its rest ends (``HopChecker.rest``). No verdict: a replica behind, or one that trained alone,
        does this honestly, and nothing here tells it from a liar."""
        outer_round = self.router.outer_round(peer)
        seconds = self.checker.rest(peer, outer_round)
        self.counters["check_rests"] += 1
        rule = self.checker.rule
        reason = (
            f"its outputs gave a loss over {rule.harm_margin:.0%} above skipping the stage in {rule.failures} of its"
            f" last {rule.history} judgements"
        )
        # not a router ban: that would outlast a sync. ``RemoteStages.choose`` leaves out ``excluded_now`` instead
        synced = "" if outer_round is None else f" or its outer round moves past {outer_round}"
        logger.warning(f"stage {stage}: {peer} unfit ({reason}); routed around for {seconds:.0f} s{synced}")

    def condemn(self, stage: int, peer: Peer, mb: Microbatch, *, why: str = "") -> None:
        """``peer`` did wrong work: banned from this trainer's routing, for longer each time (``HopChecker.condemn``)."""
        seconds = self.checker.condemn(peer)
        self.counters["check_strikes"] += 1
        reason = why or f"its work on {mb.id} was wrong"
        self.router.ban(stage, peer, seconds, reason=reason)
        logger.warning(f"stage {stage}: {peer} condemned ({reason}); banned for {seconds:.0f} s")


async def losses_down_the_path(
    calls: HopCalls, loss_of: LossOf | None, mb: Microbatch, stage: int, outputs: list[Outgoing], *, prev: int
) -> list[float] | None:
    """The trainer's loss for each of ``outputs`` (coming from stage ``prev``), each taken down the rest of ``mb``'s
    path after ``stage`` through the same replicas (not kept: ``train=False``); None if a call failed or there is no
    loss to take."""
    if loss_of is None or mb.targets is None:
        return None
    rest = mb.path[mb.path.index(stage) + 1 :] if stage in mb.path else ()
    peers = [calls.other_replica(s, []) for s in rest]  # one replica per later stage, for every output
    if any(p is None for p in peers):
        return None
    losses = []
    for out in outputs:
        came_from = prev
        for s, peer in zip(rest, peers, strict=True):
            assert peer is not None
            codec = calls.codecs.choose("activations", peer, mb.shape)
            request = Forward(mb=calls.new_id(), stage=s, prev_stage=came_from, x=out.frame(codec), train=False)
            if (reply := await calls.call(mb, peer, request, codec.name)) is None:
                return None
            out, came_from = Outgoing(*reply), s
        losses.append(await loss_of(mb, out.value))
    return losses


async def probe_outputs(
    calls: HopCalls, mb: Microbatch, hop: Hop, peer: Peer, x: Outgoing, step: torch.Tensor
) -> list[torch.Tensor] | None:
    """``peer``'s outputs at x + step and x − step, on the weights its forward of ``hop`` ran on: two forwards like
    any other (ids from the one sequence, their traffic counted as training's); None if either went unanswered."""
    assert hop.weights is not None
    epoch, step_at = hop.weights
    outputs = []
    for sign in (1.0, -1.0):
        probe = Microbatch(calls.new_id(), mb.shape, train=True)
        codec = calls.codecs.choose("activations", peer, mb.shape)
        frame = Outgoing(x.value + sign * step, x.tokens).frame(codec)
        # not kept (``train=False``): naming old weights, a probe is known for one anyway, and kept it would hold a
        # cache entry on the server that no backward ever takes
        request = Forward(
            mb=probe.id,
            stage=hop.stage,
            prev_stage=hop.prev_stage,
            x=frame,
            train=False,
            on_epoch=epoch,
            on_step=step_at,
        )
        if (reply := await calls.call(probe, peer, request, codec.name)) is None:
            return None
        outputs.append(reply[0])
    return outputs
