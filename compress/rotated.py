"""Rotated low-bit codecs for boundary tensors: a seeded randomized Hadamard rotation, then 4, 2 or 1 bit per value.

Each token's row (last dim, width d) is multiplied by fixed random signs and rotated by an orthonormal Hadamard
matrix in blocks of B (the largest power of two dividing d, at most 256): outliers spread over their block, and the
rotated values are close to Gaussian. Each value is coded as the index of its nearest Lloyd-Max level for a unit
Gaussian (2**bits levels); each row gets the least-squares scale for its codes, one byte on a log grid under a
frame-wide fp32 ``top`` (the grid of ``IntCodec``, rounded to nearest; byte 255 is an all-zero row). The decoder
rotates back. Signs and matrix are derived from d alone, so sender and receiver agree without any state. On Gaussian
values the relative error is 10% (rot4), 34% (rot2), 60% (rot1); what that costs in training: docs/benchmarks.md.

    >>> y = get_codec("rot2").decode(get_codec("rot2").encode(torch.randn(8, 1024, 768)))  # 34% relative error
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from compress.codec_base import Codec, Packed, as_checks, from_bytes, largest_value
from compress.codecs import _LOW_BIT
from compress.errors import MalformedFrame, ShapeMismatch
from compress.wire import CodecId, Frame

# Lloyd-Max reconstruction levels of a unit Gaussian, positive half (the negative half mirrors it)
_LLOYD_MAX: dict[int, tuple[float, ...]] = {
    1: (0.7979,),
    2: (0.4528, 1.5104),
    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326),
}
_CODEC_IDS = {4: CodecId.ROT4, 2: CodecId.ROT2, 1: CodecId.ROT1}
MAX_BLOCK = 256  # the widest Hadamard block: d=768 → 256, d=384 → 128, d=2048 → 256
ROTATION_SEED = 0x5EED  # the signs' seed, with d: part of the wire format (a change makes old frames garbage)
_STEPS = 16.0  # row scale = top · 2**(-s / 16), s in 0..254: steps of 4.4%, 2**-15.9 below the largest
_ZERO_ROW = 255


def block_size(d: int) -> int:
    """The Hadamard block for rows of width ``d``: its largest power-of-two divisor, at most ``MAX_BLOCK``."""
    return min(d & -d, MAX_BLOCK) if d > 0 else 1


# widths whose rotation is kept: the model's one width (a few, across models), never one per width a sender declares
# (a stage server decodes a request before it checks its width against the model's, so a sender picks d)
ROTATIONS_KEPT = 8


@functools.lru_cache(maxsize=ROTATIONS_KEPT)
def _rotation(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(signs (d,), orthonormal Hadamard (B, B)) for width ``d``, on the CPU; made once per width (of the last few)."""
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(ROTATION_SEED + d)).float() * 2 - 1
    h = torch.ones(1, 1)
    while len(h) < block_size(d):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # Sylvester's construction
    return signs, h / math.sqrt(len(h))


def _placed(d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    signs, h = _rotation(d)
    return signs.to(device), h.to(device)


def rotate(x2: torch.Tensor) -> torch.Tensor:
    """(N, d) rows → their randomized Hadamard rotation (orthonormal: norms are kept)."""
    n, d = x2.shape
    signs, h = _placed(d, x2.device)
    b = len(h)
    return ((x2 * signs).reshape(n, d // b, b) @ h).reshape(n, d)


def unrotate(y2: torch.Tensor) -> torch.Tensor:
    """The inverse of ``rotate`` (H is symmetric and orthonormal; the signs are their own inverse)."""
    n, d = y2.shape
    signs, h = _placed(d, y2.device)
    b = len(h)
    return (y2.reshape(n, d // b, b) @ h).reshape(n, d) * signs


class RotatedCodec(Codec):
    """Randomized Hadamard rotation per token, then ``bits`` ∈ {4, 2, 1} per value and one scale byte per token."""

    def __init__(self, bits: int) -> None:
        if bits not in _LLOYD_MAX:
            raise ValueError(f"rotated codecs code 4, 2 or 1 bits per value, got {bits}")
        self.bits, self.name, self.codec_id = bits, f"rot{bits}", _CODEC_IDS[bits]
        half = torch.tensor(_LLOYD_MAX[bits])
        self.levels = torch.cat([-half.flip(0), half])  # 2**bits ascending levels, code = index
        self.thresholds = (self.levels[1:] + self.levels[:-1]) / 2
        self.per_byte = 8 // bits

    def row_bytes(self, d: int) -> int:
        return -(-d // self.per_byte)

    def payload_bytes(self, x_shape: tuple[int, ...]) -> int:
        return 4 + math.prod(x_shape[:-1]) * (1 + self.row_bytes(x_shape[-1]))

    def pack_parts(self, x: torch.Tensor, tokens: torch.Tensor | None, *, saturate: bool = False) -> Packed:
        if x.ndim == 0:
            raise ValueError(f"{self.name} codes per token (last dim); got a 0-dim tensor")
        y = rotate(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).float())  # (N, d)
        levels, thresholds = self.levels.to(y.device), self.thresholds.to(y.device)
        rms = y.square().mean(1, keepdim=True).sqrt_() if y.shape[1] else y.new_zeros(len(y), 1)
        codes = torch.bucketize(y / torch.where(rms > 0, rms, 1.0), thresholds)  # nearest level's index
        values = levels[codes]
        fit = (y * values).sum(1) / values.square().sum(1).clamp_min(1e-30)  # least-squares scale per row
        largest = fit.max() if len(fit) else fit.new_zeros(())  # NaN or inf refuse the tensor (``validate``)
        top = torch.where(largest > 0, largest, 1.0)
        steps = (-_STEPS * torch.log2(fit / top)).round_().clamp_(0, _ZERO_ROW - 1)
        steps = torch.where(fit > 0, steps, float(_ZERO_ROW)).to(torch.uint8)
        reach = largest * self.reach(y.shape[1])  # the largest |value| the frame can decode to: finite, or refused
        return Packed(meta=(top.reshape(1),), body=(steps, self._packed(codes)), source=x, checks=(as_checks(reach),))

    def reach(self, d: int) -> float:
        """The largest |decoded value| per unit of ``top``: the largest level, spread back over a block."""
        return float(self.levels.max()) * math.sqrt(block_size(d))

    def _packed(self, codes: torch.Tensor) -> torch.Tensor:
        """(N, d) codes in [0, 2**bits) → (N, row_bytes) uint8, the first value in the lowest bits."""
        n, d = codes.shape
        codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, -d % self.per_byte))
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=codes.device)
        # every size explicit: with no tokens (n = 0) a -1 could be any size, which torch refuses
        return (codes.reshape(n, self.row_bytes(d), self.per_byte) << shifts).sum(2, dtype=torch.uint8)

    def validate(self, packed: Packed, checks: list[float]) -> bool:
        if not math.isfinite(checks[0]):
            raise ValueError(
                f"{self.name} cannot encode NaN or inf values (or values so large their decoding overflows fp32)"
            )
        return False

    def unpack(self, frame: Frame, body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not frame.shape or len(frame.meta) != 4:
            raise ShapeMismatch(
                f"{self.name} frame needs ≥ 1 dim and 4 meta bytes, got shape {frame.shape}, {len(frame.meta)} meta bytes"
            )
        d, n = frame.shape[-1], math.prod(frame.shape[:-1])
        top = self._top(frame)
        steps = from_bytes(body[:n], torch.uint8, n, f"{self.name} scales")
        packed = from_bytes(body[n:], torch.uint8, n * self.row_bytes(d), f"{self.name} values")
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=body.device)
        width = self.row_bytes(d) * self.per_byte  # d, padded to whole bytes (explicit: n may be 0, see ``_packed``)
        codes = ((packed.reshape(n, self.row_bytes(d), 1) >> shifts) & (2**self.bits - 1)).reshape(n, width)[:, :d]
        scales = top * torch.exp2(steps.float() / -_STEPS)
        scales = torch.where(steps == _ZERO_ROW, 0.0, scales)
        y = self.levels.to(body.device)[codes.long()] * scales[:, None]
        return unrotate(y).reshape(frame.shape), None

    def _top(self, frame: Frame) -> float:
        """The frame's ``top``, refused beyond what an honest encoder makes of a finite tensor of the frame's dtype."""
        top: float = struct.unpack("<f", frame.meta)[0]
        d = frame.shape[-1]
        # a row's least-squares scale is at most its largest rotated |value| / the smallest level, and a rotated value
        # at most sqrt(B) times the largest input value; and no decoded value may overflow fp32 (the encoder refuses)
        bound = largest_value(frame.dtype) * math.sqrt(block_size(d)) / float(self.levels.abs().min())
        bound = min(bound, torch.finfo(torch.float32).max / self.reach(d))
        if not 0 < top <= bound:
            raise MalformedFrame(
                f"{self.name} frame's scale {top:.6g} is outside (0, {bound:.6g}], what a finite {frame.dtype} tensor "
                "can be coded with"
            )
        return top


ROTATED_CODECS: dict[str, Codec] = {c.name: c for c in (RotatedCodec(4), RotatedCodec(2), RotatedCodec(1))}
_LOW_BIT.update(ROTATED_CODECS)  # ``get_codec``'s
