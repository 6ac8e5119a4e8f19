"""NoLoCo: no all-reduce; each replica averages with one partner per round (Kolehmainen et al., 2025).

Every replica keeps its own outer weights θᵢ and heavy-ball momentum; paired by ``partners`` (seeded with the
round), it steps ``SGD(lr, momentum)`` on g = mean_pair(Δ) + (θᵢ − mean_pair(θ)): a DiLoCo step plus a
gossip pull towards its partner. The math, its source and how live rounds pair: docs/architecture.md, optim/.

    >>> opt = NoLoCo(dict(model.named_parameters()), lr=0.7, momentum=0.5, codec=get_codec("fp32"))
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

import torch

from compress.codec_base import Codec
from compress.codecs import get_codec
from compress.errors import MalformedFrame
from compress.wire import BytesLike
from optim.inner import fused_kwargs
from optim.outer import NamedTensors, OuterOptimizer, Screening

_SPLIT = struct.Struct("<I")  # length of the Δ frame; the weights frame follows it


@dataclass(frozen=True)
class PairPart:
    """One member's decoded Δ and outer weights θ for one parameter."""

    name: str
    delta: torch.Tensor
    weights: torch.Tensor


def partners(count: int, round_: int) -> list[list[int]]:
    """Split member indices 0..count−1 into random pairs (a triple when count is odd), the same on every member.

    >>> partners(4, round_=7)  # e.g. [[2, 0], [3, 1]]
    """
    order = list(range(count))
    random.Random(round_).shuffle(order)
    groups = [order[i : i + 2] for i in range(0, count - 1, 2)]
    if count % 2:
        if groups:
            groups[-1].append(order[-1])
        else:
            groups.append(order)
    return groups


class NoLoCo(OuterOptimizer[PairPart]):
    """Pairwise gossip outer step: Δ through ``codec``, outer weights in fp32, heavy-ball SGD (lr 0.7, momentum 0.5)."""

    replicas_agree = False  # each keeps its own outer weights; the pull towards partners brings them together
    pairwise = True  # a live round fetches the partner's payload only (swarm/outer/pairs.py, pair_round)

    def __init__(self, params: NamedTensors, *, lr: float = 0.7, momentum: float = 0.5, codec: Codec) -> None:
        super().__init__(params, lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, **fused_kwargs(ps)))
        self.codec = codec
        self.weights_codec = get_codec("fp32")  # the consensus term needs the partner's weights exactly
        self._my_payload: bytes | None = None

    def make_payload(self, local: NamedTensors) -> bytes:
        self._my_payload = super().make_payload(local)
        return self._my_payload

    def apply(self, payloads: list[bytes], local: NamedTensors) -> Screening:
        """Step with my partner's payload (chosen from the round's ``payloads``), not the whole group's.

        The screening's indices refer to ``payloads``, as for any outer optimizer.
        """
        mine = self.my_group(payloads)
        screening = super().apply([payloads[i] for i in mine], local)
        return Screening(
            used=screening.used,
            dropped={mine[i]: why for i, why in screening.dropped.items()},
            clipped={mine[i]: factor for i, factor in screening.clipped.items()},
            guarded={mine[i]: factor for i, factor in screening.guarded.items()},
            bounded={mine[i]: factor for i, factor in screening.bounded.items()},
        )

    def my_group(self, payloads: list[bytes]) -> list[int]:
        """Indices in ``payloads`` of mine and my partner's (or two partners'), as the round's shared pairing says."""
        if self._my_payload is None or self._my_payload not in payloads:
            return list(
                range(len(payloads))
            )  # I sent nothing this round: nothing to pair by (apply drops what it cannot use)
        order = sorted(range(len(payloads)), key=lambda i: payloads[i])  # the same on every member
        me = order.index(payloads.index(self._my_payload))
        group = next(g for g in partners(len(order), self.round) if me in g)
        return sorted(order[i] for i in group)

    def _encode(self, name: str, delta: torch.Tensor) -> bytes:
        delta_frame = self.codec.encode(delta)
        return _SPLIT.pack(len(delta_frame)) + delta_frame + self.weights_codec.encode(self._global[name])

    def _decode(self, name: str, frame: BytesLike) -> PairPart:
        if len(frame) < _SPLIT.size:
            raise MalformedFrame(f"{name}: NoLoCo frame of {len(frame)} bytes is shorter than its header")
        (delta_len,) = _SPLIT.unpack_from(frame)
        if _SPLIT.size + delta_len > len(frame):
            raise MalformedFrame(f"{name}: NoLoCo Δ frame of {delta_len} bytes overruns the payload")
        device = self._global[name].device  # decoded where the weights lie
        delta = self.codec.decode(frame[_SPLIT.size : _SPLIT.size + delta_len], device=device)  # rejects NaN and inf
        weights = self.weights_codec.decode(frame[_SPLIT.size + delta_len :], device=device)
        self._check_shape(name, delta.shape)
        self._check_shape(name, weights.shape)
        return PairPart(name, delta, weights)

    def _combine(self, parts: list[PairPart]) -> torch.Tensor:
        name = parts[0].name
        mean_delta = torch.stack([p.delta for p in parts]).mean(dim=0)
        mean_weights = torch.stack([p.weights for p in parts]).mean(dim=0)
        return mean_delta + (self._global[name] - mean_weights)

    def _squared_norm(self, part: PairPart) -> float:
        return float(part.delta.double().square().sum())

    def _scale(self, part: PairPart, factor: float) -> PairPart:
        return PairPart(part.name, part.delta * factor, part.weights)

    def _dense(self, part: PairPart) -> torch.Tensor:
        return part.delta.float()

    def _with_delta(self, part: PairPart, delta: torch.Tensor) -> PairPart:
        return PairPart(part.name, delta.to(part.delta), part.weights)
