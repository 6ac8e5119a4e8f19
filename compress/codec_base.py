"""What every codec is: the ``Codec`` interface (encode, pack on the tensor's device, decode under a receiver's limits)
and the helpers codecs share (bytes and dtypes, the checks an encoder makes on the host, value ranges).

A codec turns a tensor into one wire frame (``compress/wire.py``) and back. It codes on the tensor's device and sends
only the coded bytes to the host (``pack_parts`` → ``Packed``); a receiver bounds a frame by its expected shape before
allocating and refuses NaN, inf and values over its ``max_abs`` (``from_frame``). The codecs themselves and their
registry by name: ``compress/codecs.py`` (and ``rotated.py``, ``lowrank.py``).

    >>> x, tokens = codec.from_frame(decode_frame(data), max_abs=BOUNDARY_MAX_ABS)  # what ``decode`` does
"""

from __future__ import annotations

import math
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from compress.errors import LimitExceeded, NonFiniteValues, ShapeMismatch, UnknownCodec
from compress.transfer import Part, flat_bytes, to_device, to_host
from compress.wire import (
    BytesLike,
    CodecId,
    Frame,
    WireLimits,
    decode_frame,
    encode_frame,
    header_bytes,
    receiver_limits,
)

FP32_MAX = torch.finfo(torch.float32).max
# The largest |value| a receiver of boundary tensors accepts (``WireLimits.max_abs``, set by the stage server): a
# value whose square overflows fp32 makes the receiver's norms (an activation's RMSNorm, the gradient norm a stage
# server screens) inf, which no model in training produces; refused at decode, before any compute is spent on it.
BOUNDARY_MAX_ABS = 2.0**64
CPU = torch.device("cpu")


def to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def from_bytes(buf: torch.Tensor, dtype: torch.dtype, count: int, what: str) -> torch.Tensor:
    """``count`` values of ``dtype`` from exactly the uint8 tensor ``buf`` (a view where its offset allows one)."""
    if len(buf) != count * dtype.itemsize:
        raise ShapeMismatch(f"{what}: {len(buf)} bytes, expected {count} × {dtype.itemsize}")
    if buf.storage_offset() % dtype.itemsize:  # a view's start must be aligned to the dtype's size
        buf = buf.clone()
    return buf.view(dtype) if count else torch.empty(0, dtype=dtype, device=buf.device)


def _floats(data: bytes) -> list[float]:
    """The float64 values of ``as_checks``, back on the host."""
    return list(struct.unpack(f"={len(data) // 8}d", data))


def as_checks(*values: torch.Tensor) -> torch.Tensor:
    """Scalars an encoder checks once the frame's bytes are on the host, as one float64 tensor (exact for fp32 values
    and token ids)."""
    return torch.stack([v.reshape(()).double() for v in values])


@dataclass(frozen=True, kw_only=True)
class Packed:
    """A frame's coded parts, still on the device of the tensor coded: ``meta`` and ``body`` are what is sent,
    ``checks`` what the encoder validates once they are on the host (``Codec.validate``), ``source`` what was coded."""

    meta: tuple[Part, ...]
    body: tuple[Part, ...]
    source: torch.Tensor
    checks: tuple[torch.Tensor, ...] = field(default=())


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or ±inf in ``x`` (aminmax is ~10× faster than isfinite().all() on CPU, and reads bf16 as it is)."""
    lo, hi = value_range(x)
    return math.isfinite(lo) and math.isfinite(hi)


def value_range(x: torch.Tensor) -> tuple[float, float]:
    """The smallest and largest value of ``x`` (NaN if it holds one; (0, 0) if empty), in one pass."""
    if x.numel() == 0:
        return 0.0, 0.0
    lo, hi = torch.stack(torch.aminmax(x if x.dtype.is_floating_point else x.float())).tolist()  # one sync
    return lo, hi


def largest_value(dtype: torch.dtype) -> float:
    """The largest magnitude a finite tensor of ``dtype`` holds, as far as an fp32 scale can carry it: what bounds
    the scale of a frame an honest encoder made from that tensor."""
    if dtype.is_floating_point:
        return min(torch.finfo(dtype).max, FP32_MAX)
    return 1.0 if dtype == torch.bool else min(float(-torch.iinfo(dtype).min), FP32_MAX)


class Codec(ABC):
    """encode(tensor) → frame bytes; decode(frame bytes) → float32 tensor of the same shape."""

    name: str
    codec_id: CodecId

    def encode(self, x: torch.Tensor, *, tokens: torch.Tensor | None = None) -> bytes:
        meta, body = self.pack(x, tokens)
        return encode_frame(self.codec_id, body, dtype=x.dtype, shape=tuple(x.shape), meta=meta)

    def pack(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> tuple[bytes, bytes]:
        """(meta, body) of ``x``'s frame: coded on ``x``'s device, and only the coded bytes cross to the host, in one
        copy (``compress/transfer.py``) after which the host waits once; the values that decide whether the tensor can
        be coded travel with them and are checked here. (A bf16 frame of values beyond bf16's range is coded twice.)"""
        _, meta, body = self._pack_checked(x.detach(), tokens, body_to_host=True)
        return meta, body

    def round_trip(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """``x`` as a receiver decodes its frame, and the frame's bytes before zstd, without the body leaving ``x``'s
        device (its meta and checks cross, a few bytes): the simulator's link where zstd is not counted."""
        x = x.detach()
        packed, meta, _ = self._pack_checked(x, tokens, body_to_host=False)
        body = torch.cat([flat_bytes(p) for p in packed.body if isinstance(p, torch.Tensor)])
        frame = Frame(codec_id=self.codec_id, dtype=x.dtype, shape=tuple(x.shape), meta=meta, body=b"")
        return self.unpack(frame, body)[0], header_bytes(x.ndim) + len(meta) + body.numel()

    def _pack_checked(
        self, x: torch.Tensor, tokens: torch.Tensor | None, *, body_to_host: bool
    ) -> tuple[Packed, bytes, bytes]:
        """The coded parts of ``x``, checked, with the bytes of their meta and (if ``body_to_host``, else b"") body."""
        packed = self.pack_parts(x, tokens)
        meta, body, checks = to_host([packed.meta, packed.body if body_to_host else (), packed.checks])
        if self.validate(packed, _floats(checks)):
            packed = self.pack_parts(x, tokens, saturate=True)
            meta, body = to_host([packed.meta, packed.body if body_to_host else ()])
        return packed, meta, body

    def validate(self, packed: Packed, checks: list[float]) -> bool:
        """Raise ValueError if the checked values say the tensor cannot be coded; True where it must be coded again
        with ``saturate`` (values beyond a float codec's range)."""
        return False

    def decode(
        self,
        data: BytesLike,
        *,
        limits: WireLimits | None = None,
        allow_nonfinite: bool = False,
        expected_shape: tuple[int, ...] | None = None,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        return self.decode_with_tokens(
            data, limits=limits, allow_nonfinite=allow_nonfinite, expected_shape=expected_shape, device=device
        )[0]

    def decode_with_tokens(
        self,
        data: BytesLike,
        *,
        limits: WireLimits | None = None,
        allow_nonfinite: bool = False,
        expected_shape: tuple[int, ...] | None = None,
        device: torch.device | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensor and, for subspace activations, the token ids the frame carries (else None), on ``device``
        (default the CPU): only the frame's body crosses to it, and it is decoded there.

        ``expected_shape``: the receiver's own shape for the tensor. A frame declaring another is
        refused from its header, and the body may not exceed what that shape needs in this codec
        (``limits_for``), so nothing is allocated for a tensor the receiver does not hold;
        ``limits`` (default ``DEFAULT_LIMITS``) tighten that further.
        """
        shape_limits = None if expected_shape is None else self.limits_for(tuple(expected_shape))
        bounds = receiver_limits(limits, shape_limits)
        frame = decode_frame(data, limits=bounds, expected_shape=expected_shape)
        return self.from_frame(frame, allow_nonfinite=allow_nonfinite, max_abs=bounds.max_abs, device=device)

    def limits_for(self, shape: tuple[int, ...]) -> WireLimits:
        """The bounds of a frame of ``shape`` in this codec: no more metadata and body than the shape needs."""
        needed = self.payload_bytes(shape)  # meta + body
        return WireLimits.for_shape(shape, body_bytes=needed, meta_bytes=needed)

    def from_frame(
        self,
        frame: Frame,
        *,
        allow_nonfinite: bool = False,
        max_abs: float = math.inf,
        device: torch.device | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The frame's tensor and token ids, on ``device`` (default the CPU), where the body is decoded; refused if it
        holds NaN or inf (unless allowed) or |values| > ``max_abs``."""
        if not self.matches(frame):
            raise UnknownCodec(f"frame has codec id {frame.codec_id}, expected {self.name!r} (id {int(self.codec_id)})")
        x, tokens = self.unpack(frame, to_device(frame.body, device or CPU))
        lo, hi = value_range(x)
        if not allow_nonfinite and not (math.isfinite(lo) and math.isfinite(hi)):
            raise NonFiniteValues(f"{self.name} frame of shape {frame.shape} decodes to NaN or inf values")
        if max(-lo, hi) > max_abs:
            raise LimitExceeded(
                f"{self.name} frame of shape {frame.shape} decodes to values up to {max(-lo, hi):.3g} in magnitude, "
                f"over the receiver's limit of {max_abs:.3g}"
            )
        return x, tokens

    def matches(self, frame: Frame) -> bool:
        return frame.codec_id == self.codec_id

    def estimated_ratio(self, x_shape: tuple[int, ...]) -> float:
        """fp32 bytes of the tensor / bytes of its frame (before zstd, which only helps)."""
        return 4 * math.prod(x_shape) / (header_bytes(len(x_shape)) + self.payload_bytes(x_shape))

    @abstractmethod
    def pack_parts(self, x: torch.Tensor, tokens: torch.Tensor | None, *, saturate: bool = False) -> Packed:
        """The coded parts of ``x``, computed on its device without waiting for it."""

    @abstractmethod
    def unpack(self, frame: Frame, body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(float32 tensor of ``frame.shape``, tokens or None) from ``body``, the frame's body as a uint8 tensor on the
        device to decode on; raises WireError on a bad body."""

    @abstractmethod
    def payload_bytes(self, x_shape: tuple[int, ...]) -> int:
        """Bytes of meta + body for a tensor of this shape."""
