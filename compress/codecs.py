"""Codecs for activations and activation-gradients, and their registry by name.

A codec turns a tensor into one wire frame (``compress/wire.py``) and back: ``fp32``, ``fp16``, ``bf16``
(cast), ``int8``, ``int4`` (per-token absmax) and ``subspace[+inner]`` (the subspace-constrained model's
boundary). Codecs are stateless; the pseudo-gradient codec is ``compress/sparseloco.py``. How each one codes,
and why the subspace gradient is exact: docs/architecture.md, compress/.

    >>> y = get_codec("int8").decode(get_codec("int8").encode(torch.randn(4, 128, 64)))  # ~0.5% relative error
"""

from __future__ import annotations

import math
import struct
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from compress.errors import LimitExceeded, MalformedFrame, NonFiniteValues, ShapeMismatch, UnknownCodec
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

Kind = Literal["activation", "gradient"]
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
    """The float64 values of ``_as_checks``, back on the host."""
    return list(struct.unpack(f"={len(data) // 8}d", data))


def _as_checks(*values: torch.Tensor) -> torch.Tensor:
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


class FloatCodec(Codec):
    """The values cast to a float dtype. fp16 refuses values beyond ±65504 and loses gradients
    below ~1e-5 to its subnormals: bf16 suits gradients better."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name, self.codec_id = {
            torch.float32: ("fp32", CodecId.FP32),
            torch.float16: ("fp16", CodecId.FP16),
            torch.bfloat16: ("bf16", CodecId.BF16),
        }[dtype]

    def pack_parts(self, x: torch.Tensor, tokens: torch.Tensor | None, *, saturate: bool = False) -> Packed:
        # fp32 values beyond bf16's largest (3.3895e38) cast to inf: saturated instead, within bf16's 0.4% step
        top = torch.finfo(torch.bfloat16).max
        y = x.clamp(-top, top).to(self.dtype) if saturate else x.to(self.dtype)
        narrow = self.dtype in (torch.float16, torch.bfloat16) and y.numel() > 0
        return Packed(meta=(), body=(y,), source=x, checks=(_as_checks(*torch.aminmax(y)),) if narrow else ())

    def validate(self, packed: Packed, checks: list[float]) -> bool:
        """A narrow cast that made a finite tensor's values inf: fp16 refuses them, bf16 saturates them."""
        if all(map(math.isfinite, checks)) or not all_finite(packed.source):  # (a rare case: one more sync)
            return False
        if self.dtype == torch.float16:
            raise ValueError("values beyond fp16's range (±65504); use bf16")
        return True

    def unpack(self, frame: Frame, body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return from_bytes(body, self.dtype, frame.numel, self.name).float().reshape(frame.shape), None

    def payload_bytes(self, x_shape: tuple[int, ...]) -> int:
        return math.prod(x_shape) * self.dtype.itemsize


_SCALE_STEPS = 16.0  # token scale = top · 2**(-s / 16): steps of 4.4%, range 2**-16 below the largest


def _largest_top(levels: int) -> float:
    """The largest fp32 ``top`` whose full-scale value, levels · (top / levels) in fp32 as ``IntCodec.unpack``
    computes it, is finite: 127 · (FP32_MAX / 127) rounds to inf."""
    top = torch.tensor(FP32_MAX)
    while not torch.isfinite(levels * (top / levels)):
        top = torch.nextafter(top, torch.tensor(0.0))
    return float(top)


class IntCodec(Codec):
    """Symmetric per-token (last dim) absmax quantisation to int8, or int4 packed two per byte."""

    def __init__(self, bits: Literal[8, 4]) -> None:
        self.bits = bits
        self.levels: int = 2 ** (bits - 1) - 1  # ±127 or ±7
        self.name, self.codec_id = {8: ("int8", CodecId.INT8), 4: ("int4", CodecId.INT4)}[bits]
        self.largest_top = _largest_top(self.levels)

    def row_bytes(self, d: int) -> int:
        return d if self.bits == 8 else (d + 1) // 2

    def pack_parts(self, x: torch.Tensor, tokens: torch.Tensor | None, *, saturate: bool = False) -> Packed:
        if x.ndim == 0:
            raise ValueError(f"{self.name} quantises per token (last dim); got a 0-dim tensor")
        x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).float()  # (N, d)
        amax = x2.abs().amax(1) if x2.shape[1] else x2.new_zeros(len(x2))  # (N,)
        largest = amax.max() if len(amax) else amax.new_zeros(())  # NaN or inf refuse the tensor (``validate``)
        top = torch.where(largest > 0, largest, 1.0).clamp_(max=self.largest_top)  # all-zero: a usable scale
        # largest s with top·2^(-s/16) ≥ amax, so no value clips; the clamp absorbs rounding
        steps = (-_SCALE_STEPS * torch.log2(amax / top)).floor_().clamp_(0, 255).to(torch.uint8)
        q = (x2 / self.scales(steps, top)[:, None]).round_().clamp_(-self.levels, self.levels).to(torch.int8)
        if self.bits == 4:
            q = F.pad(q + 8, (0, q.shape[1] % 2), value=8).view(torch.uint8)  # nibbles 1..15, 8 is zero
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        # the scale as the little-endian fp32 ``struct.pack("<f")`` wrote (every host torch runs on is little-endian)
        return Packed(meta=(top.reshape(1),), body=(steps, q), source=x, checks=(_as_checks(largest),))

    def validate(self, packed: Packed, checks: list[float]) -> bool:
        if not math.isfinite(checks[0]):
            raise ValueError(f"{self.name} cannot encode NaN or inf values")
        return False

    def scales(self, steps: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        return top * torch.exp2(steps.float() / -_SCALE_STEPS) / self.levels

    def unpack(self, frame: Frame, body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not frame.shape or len(frame.meta) != 4:
            raise ShapeMismatch(
                f"{self.name} frame needs ≥ 1 dim and 4 meta bytes, got shape {frame.shape}, {len(frame.meta)} meta bytes"
            )
        d = frame.shape[-1]
        n = math.prod(frame.shape[:-1])
        top = torch.tensor(self._scale(frame), device=body.device)
        steps = from_bytes(body[:n], torch.uint8, n, f"{self.name} scales")
        q = from_bytes(body[n:], torch.uint8, n * self.row_bytes(d), f"{self.name} values").view(n, self.row_bytes(d))
        if self.bits == 8:
            q = q.view(torch.int8)
        else:
            q = torch.stack((q & 15, q >> 4), dim=-1).view(n, 2 * q.shape[1])[:, :d].to(torch.int8) - 8
        return (q * self.scales(steps, top)[:, None]).reshape(frame.shape), None

    def _scale(self, frame: Frame) -> float:
        """The frame's ``top``, refused beyond what the encoder makes of a finite tensor of the frame's dtype: the
        absmax of its values (a bf16 one is at most 3.3895e38, an fp16 one 65504), 1.0 for all zeros, never ≤ 0."""
        top: float = struct.unpack("<f", frame.meta)[0]
        bound = min(largest_value(frame.dtype), self.largest_top)
        if not 0 < top <= bound:
            raise MalformedFrame(
                f"{self.name} frame's scale {top:.6g} is outside (0, {bound:.6g}], what a finite {frame.dtype} tensor "
                "can be coded with"
            )
        return top

    def payload_bytes(self, x_shape: tuple[int, ...]) -> int:
        return 4 + math.prod(x_shape[:-1]) * (1 + self.row_bytes(x_shape[-1]))


_SUBSPACE_META = struct.Struct("<BHI")  # inner codec id, rank k, fingerprint of U (and T)


class SubspaceCodec(Codec):
    """k values per token in span(U) (+ token ids for activations), coded by ``inner``.

    Activations must lie in ``span(U) + T[tok]``: encode checks the reconstruction and raises a
    clear error for an unconstrained model, another k or another seed. Frames carry a crc32 of
    U and T, so a receiver with a different basis gets ``ShapeMismatch`` instead of garbage.
    """

    def __init__(
        self,
        basis: torch.Tensor,
        table: torch.Tensor | None,
        *,
        inner: Codec,
        kind: Kind = "activation",
        tol: float = 1e-3,
    ) -> None:
        if basis.ndim != 2 or basis.shape[1] > basis.shape[0]:
            raise ValueError(f"subspace basis must be U of shape (d, k) with k ≤ d, got {tuple(basis.shape)}")
        if kind == "activation" and (table is None or table.ndim != 2 or table.shape[1] != basis.shape[0]):
            raise ValueError(
                f"subspace activations need the token table T of shape (vocab, d={basis.shape[0]}), got {None if table is None else tuple(table.shape)}"
            )
        if isinstance(inner, SubspaceCodec):
            raise ValueError("subspace cannot be nested in subspace")
        self.basis = basis.float().contiguous()  # (d, k)
        self.table = table.float().contiguous() if kind == "activation" and table is not None else None  # (vocab, d)
        self.inner, self.kind, self.tol = inner, kind, tol
        self.d, self.k = self.basis.shape
        self.codec_id = CodecId.SUBSPACE if kind == "activation" else CodecId.SUBSPACE_GRAD
        self.name = "subspace" if inner.codec_id == CodecId.FP32 else f"subspace+{inner.name}"
        self.fingerprint = (
            zlib.crc32(to_bytes(self.table), zlib.crc32(to_bytes(self.basis)))
            if self.table is not None
            else zlib.crc32(to_bytes(self.basis))
        )
        vocab = 0 if self.table is None else len(self.table)
        self._placed: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.token_dtype = torch.uint8 if vocab <= 256 else torch.int16 if vocab <= 2**15 else torch.int32

    def placed(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """U and T on ``device`` (copied there once)."""
        if device == CPU:
            return self.basis, self.table
        if device not in self._placed:
            self._placed[device] = self.basis.to(device), None if self.table is None else self.table.to(device)
        return self._placed[device]

    def pack_parts(self, x: torch.Tensor, tokens: torch.Tensor | None, *, saturate: bool = False) -> Packed:
        if x.ndim == 0 or x.shape[-1] != self.d:
            raise ValueError(f"subspace codec expects (..., d={self.d}) tensors, got {tuple(x.shape)}")
        x = x.float()
        basis, table = self.placed(x.device)
        if table is None:
            z = x @ basis  # (..., k): the only part of a boundary gradient any parameter sees
            inner = self.inner.pack_parts(z, None, saturate=saturate)
            return replace(inner, meta=(self._meta, *inner.meta), source=z)
        if tokens is None or tokens.shape != x.shape[:-1] or tokens.dtype.is_floating_point:
            raise ValueError(
                f"subspace activations need integer token ids of shape {tuple(x.shape[:-1])}, got {None if tokens is None else (tuple(tokens.shape), tokens.dtype)}"
            )
        tokens = tokens.to(x.device)
        lo, hi = torch.aminmax(tokens) if tokens.numel() else (tokens.new_zeros(()), tokens.new_zeros(()))
        # clamped: an id outside the table is refused once the checks reach the host (``validate``), and a device's
        # gather must not read past the table meanwhile
        base = F.embedding(tokens.clamp(0, len(table) - 1), table)  # (..., d)
        z = (x - base) @ basis  # (..., k)
        residual = torch.linalg.vector_norm(x - base - z @ basis.T), torch.linalg.vector_norm(x)
        inner = self.inner.pack_parts(z, None, saturate=saturate)
        return Packed(
            meta=(self._meta, *inner.meta),
            body=(tokens.to(self.token_dtype), *inner.body),
            source=z,
            checks=(_as_checks(lo, hi, *residual), *inner.checks),
        )

    @property
    def _meta(self) -> bytes:
        return _SUBSPACE_META.pack(self.inner.codec_id, self.k, self.fingerprint)

    def validate(self, packed: Packed, checks: list[float]) -> bool:
        """Token ids in the table and activations in ``span(U) + T[tok]`` (then the inner codec's checks of z)."""
        if self.table is not None:
            (lo, hi, off, norm), checks = checks[:4], checks[4:]
            if not 0 <= lo <= hi < len(self.table):
                raise ValueError(f"token ids must be in [0, {len(self.table)})")
            residual = off / max(norm, 1e-30)
            if not residual <= self.tol:
                raise ValueError(
                    f"activations are not in the subspace (relative residual {residual:.3g} > {self.tol:g}): the model is not "
                    f"subspace-constrained, or its rank/seed differs from this codec's basis (d={self.d}, k={self.k})"
                )
        return self.inner.validate(packed, checks)

    def matches(self, frame: Frame) -> bool:
        return frame.codec_id == self.codec_id and frame.meta[:1] == bytes([self.inner.codec_id])

    def unpack(self, frame: Frame, body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if len(frame.meta) < _SUBSPACE_META.size or not frame.shape:
            raise ShapeMismatch(f"{self.name} frame needs ≥ 1 dim and a {_SUBSPACE_META.size}-byte meta header")
        _, k, fingerprint = _SUBSPACE_META.unpack_from(frame.meta)
        if k != self.k or frame.shape[-1] != self.d:
            raise ShapeMismatch(
                f"frame was coded with d={frame.shape[-1]}, k={k}; this codec's basis has d={self.d}, k={self.k}"
            )
        if fingerprint != self.fingerprint:
            raise ShapeMismatch(
                "frame was coded with a different subspace basis or token table (another subspace_seed?)"
            )
        n = math.prod(frame.shape[:-1])
        n_tok = 0 if self.table is None else n * self.token_dtype.itemsize
        tokens = None
        if self.table is not None:
            tokens = from_bytes(body[:n_tok], self.token_dtype, n, "token ids").long()
            if n and not 0 <= int(tokens.min()) <= int(tokens.max()) < len(self.table):
                raise MalformedFrame(f"token ids outside [0, {len(self.table)})")
        inner = replace(
            frame,
            codec_id=self.inner.codec_id,
            dtype=torch.float32,  # the sender coded z = (x − T[tok]) U in fp32, whatever x's dtype
            shape=(*frame.shape[:-1], self.k),
            meta=frame.meta[_SUBSPACE_META.size :],
            body=memoryview(frame.body)[n_tok:],
        )
        z, _ = self.inner.unpack(inner, body[n_tok:])  # (..., k)
        basis, table = self.placed(body.device)
        h = z @ basis.T
        if tokens is None or table is None:  # (both or neither)
            return h, None
        tokens = tokens.reshape(frame.shape[:-1])
        return h + F.embedding(tokens, table), tokens

    def payload_bytes(self, x_shape: tuple[int, ...]) -> int:
        n_tok = 0 if self.table is None else math.prod(x_shape[:-1]) * self.token_dtype.itemsize
        return _SUBSPACE_META.size + n_tok + self.inner.payload_bytes((*x_shape[:-1], self.k))


# The codec names, once: the config's choices (compress/config.py) and the CLI's read these aliases.
FloatCodecName = Literal["fp32", "fp16", "bf16"]
FlatCodecName = Literal[FloatCodecName, "int8", "int4"]
# below 4 bits a value: compress/rotated.py (rotN), compress/lowrank.py (lowrankR)
LowBitCodecName = Literal["rot4", "rot2", "rot1", "lowrank16", "lowrank32"]
CodecName = Literal[
    FlatCodecName, LowBitCodecName, "subspace", "subspace+fp16", "subspace+bf16", "subspace+int8", "subspace+int4"
]
PseudoGradientCodecName = Literal[FloatCodecName, "sparseloco"]  # DiLoCo sends a float codec; SparseLoCo its own

_FLAT: dict[str, Codec] = {
    c.name: c
    for c in (
        FloatCodec(torch.float32),
        FloatCodec(torch.float16),
        FloatCodec(torch.bfloat16),
        IntCodec(8),
        IntCodec(4),
    )
}
# compress/rotated.py and compress/lowrank.py build on this module and add theirs here when imported, which the
# package does first (compress/__init__.py)
_LOW_BIT: dict[str, Codec] = {}
CODEC_NAMES: tuple[CodecName, ...] = get_args(CodecName)
if CODEC_NAMES != (
    *_FLAT,
    *get_args(LowBitCodecName),
    *(f"subspace+{n}" if n != "fp32" else "subspace" for n in _FLAT),
):  # the aliases name what the registry holds
    raise ImportError(f"compress.codecs: CodecName {CODEC_NAMES} disagrees with the codec registry {tuple(_FLAT)}")


def get_codec(
    name: str, *, basis: torch.Tensor | None = None, table: torch.Tensor | None = None, kind: Kind = "activation"
) -> Codec:
    """A codec by name: fp32, fp16, bf16, int8, int4, rot4, rot2, rot1, lowrank16, lowrank32, subspace, subspace+{fp16,bf16,int8,int4}.

    Subspace codecs need the model's basis U (d×k) and, for ``kind="activation"``, its token
    table T (vocab×d), as ``swarm.model.transformer.subspace_basis(cfg)`` returns them. ``kind`` only
    matters for subspace codecs; the others code activations and gradients alike.
    """
    if kind not in ("activation", "gradient"):
        raise ValueError(f"kind must be 'activation' or 'gradient', got {kind!r}")
    if name in _FLAT:
        return _FLAT[name]
    if name in _LOW_BIT:
        return _LOW_BIT[name]
    head, _, inner = name.partition("+")
    if head != "subspace" or name not in CODEC_NAMES:
        raise ValueError(f"unknown codec {name!r}; choose from {', '.join(CODEC_NAMES)}")
    if basis is None:
        raise ValueError(
            f"codec {name!r} needs the model's subspace basis (swarm.model.subspace_basis(cfg)); is model.subspace_rank set?"
        )
    return SubspaceCodec(basis, table, inner=_FLAT[inner or "fp32"], kind=kind)
