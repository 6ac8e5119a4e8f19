"""Link-adaptive boundary codecs: per link, the least lossy codec whose frames cross it within the hop's compute time.

A ``Ladder`` is the codecs one kind of boundary tensor may travel in, least lossy first (a fixed codec is a
ladder of one; ``"adaptive"`` is bf16 → int8 → int4); ``LinkEstimator`` measures each link from the RPCs, and
``choose_codec`` picks a rung for a ``LinkEstimate``. The rule and its reasons: docs/architecture.md, pipeline/.

    >>> codec = choose_codec(ladder, (16, 128, 512), LinkEstimate(seconds_per_byte=1e-8, compute_s=0.05))  # bf16
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from compress.codec_base import Codec
from compress.errors import UnknownCodec
from compress.wire import WireLimits, decode_frame, frame_codec_id, header_bytes, receiver_limits

ADAPTIVE = "adaptive"  # the config value that selects a ladder
ADAPTIVE_LADDER = ("bf16", "int8", "int4")  # bf16, not fp16: fp16 cannot encode values beyond ±65504
ADAPTIVE_START = "int8"  # before a link is measured: the default codec of a fixed swarm
EMA_ALPHA = 0.2  # weight of the newest measurement of a link


class Ladder:
    """The codecs a kind of boundary tensor may travel in, least lossy first; ``start``: the index used unmeasured."""

    def __init__(self, codecs: Sequence[Codec], *, start: int = 0) -> None:
        if not codecs or not 0 <= start < len(codecs):
            raise ValueError(f"a ladder needs at least one codec and a start among them, got {len(codecs)}, {start}")
        self.codecs, self.start = tuple(codecs), codecs[start]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(codec.name for codec in self.codecs)

    def decode(
        self,
        data: bytes,
        *,
        limits: WireLimits | None = None,
        allow_nonfinite: bool = False,
        expected_shape: tuple[int, ...] | None = None,
        max_abs: float = math.inf,
        device: torch.device | None = None,
    ) -> tuple[Codec, torch.Tensor, torch.Tensor | None]:
        """(the codec the frame is in, its tensor, its token ids or None), as ``Codec.decode_with_tokens`` checks it
        and on ``device`` (default the CPU), where it is decoded; ``UnknownCodec`` for a frame in a codec outside the
        ladder; ``max_abs`` tightens ``limits.max_abs`` (a trainer bounds the replies it decodes without restating the
        shape's bounds). Raises only ``WireError``s."""
        codec_id = frame_codec_id(data)
        if codec_id is None:  # no header to read: the first codec's decode names what is wrong
            return self.codecs[0], *self.codecs[0].decode_with_tokens(data, limits=limits)
        candidates = [codec for codec in self.codecs if codec.codec_id == codec_id]  # subspace ones share an id
        if not candidates:
            raise UnknownCodec(f"frame has codec id {codec_id}; this swarm accepts only {', '.join(self.names)} here")
        shape_limits = None  # the bounds of the roomiest candidate: never above what a single codec allowed before
        if expected_shape is not None:
            shape = tuple(expected_shape)
            shape_limits = max(candidates, key=lambda codec: codec.payload_bytes(shape)).limits_for(shape)
        bounds = receiver_limits(limits, shape_limits)
        frame = decode_frame(data, limits=bounds, expected_shape=expected_shape)
        for codec in candidates:
            if codec.matches(frame):
                bound = min(bounds.max_abs, max_abs)
                return codec, *codec.from_frame(frame, allow_nonfinite=allow_nonfinite, max_abs=bound, device=device)
        raise UnknownCodec(f"frame's subspace inner codec is not one of {', '.join(self.names)}")


@dataclass(frozen=True)
class LinkEstimate:
    seconds_per_byte: float  # the wire's time per byte, both directions together
    compute_s: float  # the server's compute per call

    def round_trip_s(self, nbytes: int) -> float:
        """The wire's time for a frame of ``nbytes`` there and one as large back (the server's compute not included)."""
        return 2 * nbytes * self.seconds_per_byte

    @property
    def bytes_per_s(self) -> float:
        return 1.0 / max(self.seconds_per_byte, 1e-12)


def frame_bytes(codec: Codec, shape: tuple[int, ...]) -> int:
    """A frame of ``shape`` in ``codec``, before zstd (which only helps)."""
    return header_bytes(len(shape)) + codec.payload_bytes(shape)


def choose_codec(ladder: Ladder, shape: tuple[int, ...], link: LinkEstimate | None) -> Codec:
    """The least lossy codec whose frames, one each way, cross ``link`` within its compute time per call."""
    if link is None:
        return ladder.start
    for codec in ladder.codecs:
        if link.round_trip_s(frame_bytes(codec, shape)) <= link.compute_s:
            return codec
    return ladder.codecs[-1]


class LinkEstimator:
    """Per peer, EMAs of the wire's seconds per byte and the server's compute per call, from completed RPCs."""

    def __init__(self, alpha: float = EMA_ALPHA) -> None:
        self.alpha = alpha
        self._links: dict[Hashable, LinkEstimate] = {}

    def observe(
        self, peer: Hashable, *, nbytes: int, elapsed_s: float, server_s: float | None, compute_s: float | None
    ) -> None:
        """One RPC to ``peer``: ``nbytes`` of frames both ways in ``elapsed_s``, of which the server held it
        ``server_s`` and computed ``compute_s`` (its claims, clamped to what was measured). Ignored without them."""
        if server_s is None or compute_s is None or nbytes <= 0 or not math.isfinite(elapsed_s) or elapsed_s <= 0:
            return
        server_s = min(max(server_s, 0.0), elapsed_s)
        compute_s = min(max(compute_s, 0.0), server_s)
        wire_s = max(elapsed_s - server_s, 1e-6)  # a clock's resolution, not a free wire
        sample = LinkEstimate(seconds_per_byte=wire_s / nbytes, compute_s=compute_s)
        old = self._links.get(peer)
        self._links[peer] = (
            sample
            if old is None
            else LinkEstimate(
                seconds_per_byte=old.seconds_per_byte + self.alpha * (sample.seconds_per_byte - old.seconds_per_byte),
                compute_s=old.compute_s + self.alpha * (sample.compute_s - old.compute_s),
            )
        )

    def get(self, peer: Hashable) -> LinkEstimate | None:
        return self._links.get(peer)
