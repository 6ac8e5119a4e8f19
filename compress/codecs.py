"""Codecs for activations and activation-gradients, and their registry by name.

A codec turns a tensor into one wire frame (``compress/wire.py``) and back: ``fp32``, ``fp16``, ``bf16``
(cast), ``int8``, ``int4`` (per-token absmax) and ``subspace[+inner]`` (the subspace-constrained model's
boundary); what every codec is (the ``Codec`` interface, ``Packed``): ``compress/codec_base.py``. Codecs are
stateless; the pseudo-gradient codec is ``compress/sparseloco.py``. How each one codes,
and why the subspace gradient is exact: docs/architecture.md, compress/.

    >>> y = get_codec("int8").decode(get_codec("int8").encode(torch.randn(4, 128, 64)))  # ~0.5% relative error
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import replace
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from compress.codec_base import (
    CPU,
    FP32_MAX,
    Codec,
    Packed,
    all_finite,
    as_checks,
    from_bytes,
    largest_value,
    to_bytes,
)
from compress.errors import MalformedFrame, ShapeMismatch
from compress.wire import CodecId, Frame

Kind = Literal["activation", "gradient"]


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
        return Packed(meta=(), body=(y,), source=x, checks=(as_checks(*torch.aminmax(y)),) if narrow else ())

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
        return Packed(meta=(top.reshape(1),), body=(steps, q), source=x, checks=(as_checks(largest),))

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
            checks=(as_checks(lo, hi, *residual), *inner.checks),
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
