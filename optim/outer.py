"""Outer optimizers: the replicas of a stage agree every H inner steps (DiLoCo, SparseLoCo; NoLoCo builds on
this base in ``noloco.py``, and ``factory.py`` picks the one the config names).

A step is two phases (torchft's contract, tested without a network): ``make_payload(local)`` encodes this
replica's Δ = θ_global − θ_local, ``apply(payloads, local)`` steps a stock ``torch.optim`` on the global copy and
sets local ← global, ``apply_alone(local)`` keeps a lone round's progress. More: docs/architecture.md, optim/.

    >>> opt.apply(all_gather(opt.make_payload(local)), local)  # every H inner steps
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

import torch

from compress.codec_base import Codec
from compress.errors import WireError
from compress.sparseloco import SparseLoCoCodec, SparseTensor, aggregate_mean
from compress.wire import BytesLike
from optim.inner import fused_kwargs
from optim.payload import max_payload_bytes, pack_payload, unpack_payload
from optim.robust import Members, bound_pair, bound_to_median_norm, clip_to_centre, guard_pair

logger = logging.getLogger(__name__)

AllGather = Callable[[bytes], list[bytes]]  # send my payload, get every member's (mine included)
NamedTensors = Mapping[str, torch.Tensor]  # e.g. dict(module.named_parameters())

Part = TypeVar("Part")  # one member's decoded Δ for one parameter
# A member's ‖Δ‖ may exceed the group median ‖Δ‖ (in a pair, the other's: then it is clipped) by this factor.
MAX_NORM_RATIO = 10.0
OWN_NORM_HISTORY = 8  # rounds of this replica's own ‖Δ‖ it screens the others' against
# A pair's bound from this replica's own history. Wide, because each member of a pair judges by its own history
# (the two may decide differently, which splits the pair): honest replicas that trained at very different
# speeds or through warm-up differ by 25× and more (seen in tests/test_swarm_outer.py); a ×1000 Δ does not pass.
OWN_NORM_RATIO = 100.0
# K ≥ 3 (centred clipping, ``_clip_to_centre``): a member's Δ may lie at most this many times the members' median
# distance from their coordinate-wise median; further, it is pulled in to that radius. Honest replicas' Δ of one round
# lie within ×2 of each other's distances (tests/test_outer_robust.py), so clean rounds are never clipped.
CENTRE_RADIUS = 2.0
# K = 2, after the pair's guard: per parameter, neither member may move more than this many times what the other did
# (``robust.bound_pair``; no offence). A push at right angles of 9× the honest Δ passed every other rule and cost a
# pair 5% (DiLoCo) and 9% (SparseLoCo); with it, within 1.5% (docs/benchmarks.md). Honest replicas that trained alike
# are within a few percent of each other's norm (no measurable cost in clean pairs); ones that trained at very
# different speeds (warm-up, uneven routing) lose the faster one's excess for that round.
PAIR_BOUND_RATIO = 2.0


@dataclasses.dataclass(frozen=True)
class Screening:
    """What ``apply`` made of a round's payloads, by their index in the list it was given: who was used, who dropped
    (and why), who clipped (by which factor). A caller that knows each payload's sender can hold it to account."""

    used: int
    dropped: dict[int, str] = dataclasses.field(default_factory=dict)
    clipped: dict[int, float] = dataclasses.field(default_factory=dict)
    # a pair whose Δs pointed against each other: each one's part along the other was removed (the factor of the
    # other's Δ taken off it); no offence: a pair cannot tell which of two is wrong
    guarded: dict[int, float] = dataclasses.field(default_factory=dict)
    # scaled down, per parameter, to the median member's norm (``bounded_by_median``, K ≥ 3 SparseLoCo) or to
    # ``PAIR_BOUND_RATIO`` × the other's (K = 2): the smallest factor; no offence
    bounded: dict[int, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Screened(Generic[Part]):
    kept: list[tuple[int, dict[str, Part]]]  # (payload index, Δ) in the canonical order, clipped where need be
    dropped: dict[int, str]
    clipped: dict[int, float]


def check_shape(expected: NamedTensors, name: str, shape: torch.Size) -> None:
    """ValueError unless ``shape`` is parameter ``name``'s in ``expected``."""
    if shape != expected[name].shape:
        raise ValueError(f"{name}: shape {tuple(shape)}, expected {tuple(expected[name].shape)}")


def check_names(expected: NamedTensors, tensors: NamedTensors) -> None:
    """KeyError unless ``tensors`` names ``expected``'s parameters in its order, ValueError unless of their shapes."""
    if list(tensors) != list(expected):
        missing, extra = set(expected) - set(tensors), set(tensors) - set(expected)
        raise KeyError(
            f"parameter names differ from the outer optimizer's (missing {sorted(missing)}, extra {sorted(extra)})"
        )
    for name, t in tensors.items():
        check_shape(expected, name, t.shape)


class OuterOptimizer(ABC, Generic[Part]):
    """Global copy of a stage's parameters, moved by a stock ``torch.optim`` step on the group's Δ.

    Subclasses say how one parameter's Δ is encoded, decoded (and validated) and combined.
    """

    replicas_agree: ClassVar[bool] = True  # after a round every replica holds the same global weights (not NoLoCo)
    pairwise: ClassVar[bool] = False  # live rounds swap payloads in pairs (pair_round), no all-gather
    # K ≥ 3: every member's Δ scaled down to at most the median member's norm (``robust.bound_to_median_norm``): where
    # the centred clip has no centre (sparse payloads: the coordinate median is ~0), the bound that holds whatever a
    # minority sends. No offence: honest Δs above the median lose a few percent of their length.
    bounded_by_median: ClassVar[bool] = False

    def __init__(
        self, params: NamedTensors, make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    ) -> None:
        if not params:
            raise ValueError("outer optimizer needs at least one parameter")
        self._global = {name: p.detach().clone() for name, p in params.items()}
        self.optimizer = make_optimizer(list(self._global.values()))
        self.round = 0  # completed outer steps; part of the group's DHT key
        self._own_norms: deque[float] = deque(maxlen=OWN_NORM_HISTORY)  # ‖Δ‖ of this replica's recent payloads
        self._own_payload: bytes | None = None  # the last one it made: told apart from the others' in ``apply``

    @property
    def global_params(self) -> NamedTensors:
        return self._global

    @abstractmethod
    def _encode(self, name: str, delta: torch.Tensor) -> bytes: ...

    @abstractmethod
    def _decode(self, name: str, frame: BytesLike) -> Part:
        """Decode one member's frame for parameter ``name``; raise WireError or ValueError if it is unusable. The
        frame's declared shape must be the parameter's, checked before anything is allocated."""

    @abstractmethod
    def _combine(self, parts: list[Part]) -> torch.Tensor:
        """The group's Δ for one parameter (dense, the parameter's shape)."""

    @abstractmethod
    def _squared_norm(self, part: Part) -> float:
        """‖part‖², summed in float64 (finite for any finite float32 values)."""

    @abstractmethod
    def _scale(self, part: Part, factor: float) -> Part: ...

    @abstractmethod
    def _dense(self, part: Part) -> torch.Tensor:
        """The member's Δ for one parameter as a dense float32 tensor of its shape (what robust rules compare)."""

    @abstractmethod
    def _with_delta(self, part: Part, delta: torch.Tensor) -> Part:
        """``part`` with its Δ replaced by the dense ``delta`` (a clipped or guarded member)."""

    def make_payload(self, local: NamedTensors) -> bytes:
        """Encode my pseudo-gradient Δ = θ_global − θ_local, every parameter in one payload."""
        self._check_names(local)
        # Coded where the weights lie (SparseLoCo's error buffers too): only the coded bytes go to the host.
        frames = {name: self._encode(name, g - local[name].detach()) for name, g in self._global.items()}
        payload = pack_payload(self.round, frames)
        # what the others will receive, decoded as they will: the scale the others' Δ are screened against
        try:
            self._own_norms.append(self._member_norm(self._decode_member(payload)))
        except (WireError, ValueError):
            pass  # a non-finite Δ: the others drop it, and it says nothing of the scale of this replica's Δ
        self._own_payload = payload
        return payload

    def apply(self, payloads: list[bytes], local: NamedTensors) -> Screening:
        """Combine the group's payloads, step the global copy, reset ``local`` to it.

        A member whose payload is unusable, or whose Δ is far larger than the others' or than this
        replica's own recent ones (``_screen``), is dropped with a warning. What is left is bounded
        whatever a minority sends: centred clipping for three or more (``_clip_to_centre``), each
        member by the other in a pair (``_guard_pair``); docs/architecture.md, "The outer aggregate's
        bound". Returns how many members were used and which payloads (by index in ``payloads``) were
        dropped, clipped or guarded; with none used, nothing moves (the local parameters keep their
        progress).
        """
        self._check_names(local)
        # A canonical order makes the floating-point sums identical on every replica,
        # whatever order the exchange delivered the payloads in.
        members: list[tuple[int, dict[str, Part]]] = []
        dropped: dict[int, str] = {}
        for index in sorted(range(len(payloads)), key=lambda i: payloads[i]):
            try:
                members.append((index, self._decode_member(payloads[index])))
            except (WireError, ValueError) as e:
                logger.warning("outer round %d: dropped a pseudo-gradient: %s", self.round, e)
                dropped[index] = f"unusable: {e}"
        own = next((i for i, payload in enumerate(payloads) if payload == self._own_payload), None)
        if own is None:  # the group's set lacks this replica's Δ (it came late): its next payload must carry it again
            self.discard_payload()
        round_, self.round = self.round, self.round + 1
        screened = self._screen(members, round_, own)
        kept, clipped, guarded, bounded = screened.kept, dict(screened.clipped), dict[int, float](), dict[int, float]()
        if len(kept) >= 3:
            kept, centred = self._clip_to_centre(kept)
            clipped |= centred
            if self.bounded_by_median:
                kept, bounded = bound_to_median_norm(kept, self._global, norm=self._part_norm, scale=self._scale)
        if len(kept) == 2:
            kept, guarded = self._guard_pair(kept)
            kept, bounded = bound_pair(
                kept, self._global, norm=self._part_norm, scale=self._scale, ratio=PAIR_BOUND_RATIO
            )
        if clipped or guarded or bounded:
            logger.info(
                "outer round %d: clipped %s, guarded %s, bounded %s (payload index: factor)",
                *(round_, clipped, guarded, bounded),
            )
        screening = Screening(
            used=len(kept),
            dropped=dropped | screened.dropped,
            clipped=clipped,
            guarded=guarded,
            bounded=bounded,
        )
        if not kept:
            logger.warning("outer round %d: no usable pseudo-gradient; parameters unchanged", round_)
            self.discard_payload()
            return screening
        for name, g in self._global.items():
            g.grad = self._combine([m[name] for _, m in kept]).to(g)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.copy_global_to(local)
        return screening

    @torch.no_grad()
    def apply_alone(self, local: NamedTensors) -> None:
        """A round nobody else joined: there is nothing to agree on, so the global weights become ``local``.

        No progress is lost, and nothing is thrown away that a group round would keep: the outer
        optimizer's state (DiLoCo's momentum, SparseLoCo's error buffer of what the group has not
        received yet) is left as it is for the next round with company. The round still counts,
        so a replica alone keeps the stage's round number moving for replicas that join later.
        (Measured, docs/benchmarks.md: a Nesterov step on a lone replica's own Δ trains worse than
        this at our sizes, and a sparse top-k step drops ~98% of the progress.)
        """
        self._check_names(local)
        self.discard_payload()
        for name, g in self._global.items():
            g.copy_(local[name])
        self.round += 1

    def discard_payload(self) -> None:
        """The round the last ``make_payload`` was for applied nothing: undo what making it changed (SparseLoCo's error buffer)."""

    def step(self, local: NamedTensors, all_gather: AllGather) -> Screening:
        """One outer step: exchange Δ with the group, step, reset ``local``; returns what was used."""
        return self.apply(all_gather(self.make_payload(local)), local)

    @torch.no_grad()
    def copy_global_to(self, local: NamedTensors) -> None:
        """Overwrite ``local`` with the global parameters (after a step, or after joining)."""
        self._check_names(local)
        for name, g in self._global.items():
            local[name].copy_(g)

    def state_dict(self) -> dict[str, Any]:
        """What a joining replica adopts: global parameters, outer optimizer state, round."""
        return {"round": self.round, "params": dict(self._global), "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        params = state["params"]
        self._check_names(params)
        for name, g in self._global.items():
            g.copy_(params[name])
        # The optimizer keys its state by position; the names check above fixes the positions.
        self.optimizer.load_state_dict(state["optimizer"])
        self.round = int(state["round"])

    def _screen(self, members: list[tuple[int, dict[str, Part]]], round_: int, own: int | None) -> _Screened[Part]:
        """Defend the group against a member sending a huge (scaled, diverged or hostile) Δ; ``members`` are
        (payload index, decoded Δ), ``own`` the index of this replica's own payload if it is among them.

        Dropped first: a ‖Δ‖ that is not finite, or, in a pair, the other's over OWN_NORM_RATIO × the
        median of this replica's own recent non-zero ‖Δ‖, which every replica knows without trusting anyone.
        Then, with 3 or more members, each over MAX_NORM_RATIO × the group's median ‖Δ‖: a majority of
        honest members fixes the median. With 2 there is no majority to say which one is wrong, so
        the larger is clipped to MAX_NORM_RATIO × the smaller, bounding the harm either way. Every
        member runs this on the same payloads in the same (sorted) order; honest replicas' own ‖Δ‖
        are alike, so they make the same choice (a rare disagreement splits the group, which
        ``swarm/outer/replica.py`` repairs by download).
        """
        norms = {index: self._member_norm(member) for index, member in members}
        # Only a pair needs this replica's own history: three or more have a median. Early rounds allow more,
        # since in warm-up a replica that took fewer inner steps (random routing) has a far smaller honest Δ.
        # A round in which this replica served no microbatch (random routing) gives it Δ = 0: no bound from that.
        moved = [norm for norm in self._own_norms if norm > 0]
        own_limit = OWN_NORM_RATIO * statistics.median(moved) if moved and len(members) <= 2 else math.inf
        dropped: dict[int, str] = {}
        for index, norm in norms.items():
            if not math.isfinite(norm):
                dropped[index] = "‖Δ‖ is not finite"
            elif index != own and norm > own_limit:
                dropped[index] = f"‖Δ‖ {norm:.3g} is over {own_limit:.3g}, a bound from this replica's own ‖Δ‖"
        finite = [(index, member) for index, member in members if index not in dropped]
        norm_of = [norms[index] for index, _ in finite]
        reference = statistics.median(norm_of) if len(finite) >= 3 else min(norm_of, default=0.0)
        # no limit with fewer than two (nothing to compare with)
        limit = MAX_NORM_RATIO * reference if len(finite) >= 2 and reference > 0 else math.inf
        clipped: dict[int, float] = {}
        kept = []
        for index, member in finite:
            if norms[index] <= limit:
                kept.append((index, member))
            elif len(finite) == 2:
                clipped[index] = limit / norms[index]
                kept.append((index, self._scale_member(member, clipped[index])))
            else:
                dropped[index] = f"‖Δ‖ {norms[index]:.3g} is over {limit:.3g}, ×{MAX_NORM_RATIO:g} the group's median"
        if dropped or clipped:
            logger.warning(
                "outer round %d: of %d pseudo-gradients dropped %d (%s), clipped %d; norms %s",
                round_,
                len(members),
                len(dropped),
                "; ".join(dropped.values()),
                len(clipped),
                ", ".join(f"{norm:.3g}" for norm in norms.values()),
            )
        return _Screened(kept=kept, dropped=dropped, clipped=clipped)

    def _clip_to_centre(self, members: Members[Part]) -> tuple[Members[Part], dict[int, float]]:
        """Centred clipping (K ≥ 3, ``robust.clip_to_centre``) with this module's ``CENTRE_RADIUS``."""
        return clip_to_centre(
            members, self._global, dense=self._dense, with_delta=self._with_delta, radius_factor=CENTRE_RADIUS
        )

    def _guard_pair(self, members: Members[Part]) -> tuple[Members[Part], dict[int, float]]:
        """A pair's guard (``robust.guard_pair``): neither member's Δ may point against the other's."""
        return guard_pair(members, dense=self._dense, with_delta=self._with_delta)

    def _part_norm(self, part: Part) -> float:
        return math.sqrt(self._squared_norm(part))

    def _member_norm(self, member: Mapping[str, Part]) -> float:
        return math.sqrt(sum(self._squared_norm(part) for part in member.values()))

    def _scale_member(self, member: dict[str, Part], factor: float) -> dict[str, Part]:
        return {name: self._scale(part, factor) for name, part in member.items()}

    def _decode_member(self, payload: bytes) -> dict[str, Part]:
        round_, frames = unpack_payload(payload, max_bytes=max_payload_bytes(self._global))
        if round_ != self.round:
            raise ValueError(f"payload is for round {round_}, not {self.round}")
        if list(frames) != list(self._global):
            raise ValueError("payload's parameter names do not match this stage")
        return {name: self._decode(name, frame) for name, frame in frames.items()}

    def _check_shape(self, name: str, shape: torch.Size) -> None:
        check_shape(self._global, name, shape)

    def _check_names(self, tensors: NamedTensors) -> None:
        check_names(self._global, tensors)


class DiLoCo(OuterOptimizer[torch.Tensor]):
    """Dense Δ through ``codec``, mean over the group, Nesterov SGD (DiLoCo: lr 0.7, momentum 0.9)."""

    def __init__(self, params: NamedTensors, *, lr: float = 0.7, momentum: float = 0.9, codec: Codec) -> None:
        super().__init__(
            params, lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=momentum > 0, **fused_kwargs(ps))
        )
        self.codec = codec

    def _encode(self, name: str, delta: torch.Tensor) -> bytes:
        return self.codec.encode(delta)

    def _decode(self, name: str, frame: BytesLike) -> torch.Tensor:
        # the parameter's shape is checked from the frame's header, before any allocation; NaN and inf are refused
        g = self._global[name]
        return self.codec.decode(frame, expected_shape=tuple(g.shape), device=g.device)

    def _combine(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts).mean(dim=0)

    def _squared_norm(self, part: torch.Tensor) -> float:
        return float(part.double().square().sum())

    def _scale(self, part: torch.Tensor, factor: float) -> torch.Tensor:
        return part * factor

    def _dense(self, part: torch.Tensor) -> torch.Tensor:
        return part.float()

    def _with_delta(self, part: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return delta.to(part)


class SparseLoCo(OuterOptimizer[SparseTensor]):
    """Error feedback + top-k 2-bit Δ, per-index mean over the senders, SGD (default: plain, α = 1; optionally Nesterov).

    With three or more members each is bounded to the median member's norm, per parameter (``bounded_by_median``):
    top-k payloads barely overlap, so their coordinate median is ~0, and the per-index mean weighs a lone sender's
    value fully where nobody else sent.

    The error buffers are this replica's own residual; they are not part of ``state_dict`` and
    start at zero after ``load_state_dict``, as for a newcomer.
    """

    def __init__(self, params: NamedTensors, *, lr: float = 1.0, momentum: float = 0.0, codec: SparseLoCoCodec) -> None:
        super().__init__(
            params, lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=momentum > 0, **fused_kwargs(ps))
        )
        self.codec = codec
        self._error = codec.new_state()
        self._error_before_payload: dict[str, torch.Tensor] | None = None

    def _encode(self, name: str, delta: torch.Tensor) -> bytes:
        return self.codec.encode(name, delta, self._error)

    def _decode(self, name: str, frame: BytesLike) -> SparseTensor:
        # the parameter's shape is checked from the frame's header, before any allocation; NaN and inf, indices out
        # of range or repeated are refused
        return self.codec.decode(frame, expected_shape=tuple(self._global[name].shape))

    def _combine(self, parts: list[SparseTensor]) -> torch.Tensor:
        return aggregate_mean(parts)

    def _squared_norm(self, part: SparseTensor) -> float:
        return float(part.values.double().square().sum())

    def _scale(self, part: SparseTensor, factor: float) -> SparseTensor:
        return dataclasses.replace(part, values=part.values * factor)

    bounded_by_median: ClassVar[bool] = True

    def _dense(self, part: SparseTensor) -> torch.Tensor:
        return part.to_dense()

    def _with_delta(self, part: SparseTensor, delta: torch.Tensor) -> SparseTensor:
        # the new Δ's non-zeros are the indices it is sent on: a clipped member counts where the median moved too
        flat = delta.flatten()
        indices = flat.nonzero().flatten()
        return SparseTensor(indices=indices, values=flat[indices].float(), shape=part.shape)

    def make_payload(self, local: NamedTensors) -> bytes:
        # Encoding replaces each error buffer with a new tensor (never writes into the old one), so the
        # buffers before it are a free undo for a round that applies nothing (``discard_payload``).
        self._error_before_payload = dict(self._error.errors)
        return super().make_payload(local)

    def apply(self, payloads: list[bytes], local: NamedTensors) -> Screening:
        screening = super().apply(payloads, local)
        self._error_before_payload = None  # applied (or discarded, with no usable member): no undo any more
        return screening

    def discard_payload(self) -> None:
        if self._error_before_payload is not None:
            self._error.errors, self._error_before_payload = self._error_before_payload, None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._error, self._error_before_payload = self.codec.new_state(), None
