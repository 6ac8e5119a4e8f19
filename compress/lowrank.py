"""Low-rank boundary codecs: each frame's own top-r principal directions, and every token's r coordinates in int8.

A microbatch's tokens (N rows of width d) are coded as X ≈ Z Vᵀ: V (d × r) are the top eigenvectors of XᵀX (the
frame's own basis, sent in fp16: orthonormal columns, so every entry is in [-1, 1]), Z = X V the token coordinates,
coded by ``IntCodec(8)`` (per-token absmax, one scale byte per token). Nothing is shared between frames or peers. The
bytes are 2·d·r per frame plus (r + 1) per token: at d = 384, r = 16 and 1,024 tokens a frame, ~52× below fp32. The
model's residual stream at a boundary is close to low-rank early in training (tiny, 60 steps: rank 16 of 128 holds
99% of a middle boundary's energy); activation gradients are not (80%): the loss measures what that costs.

    >>> y = get_codec("lowrank16").decode(get_codec("lowrank16").encode(torch.randn(8, 256, 384)))
"""

from __future__ import annotations

import math
import struct
from dataclasses import replace

import torch

from compress.codec_base import Codec, Packed, from_bytes
from compress.codecs import _LOW_BIT, IntCodec
from compress.errors import MalformedFrame, ShapeMismatch
from compress.wire import CodecId, Frame

_META = struct.Struct("<H")  # the frame's rank (≤ the codec's, ≤ d, ≤ N)
_CODEC_IDS = {16: CodecId.LOWRANK16, 32: CodecId.LOWRANK32}
_COORDS = IntCodec(8)
BASIS_SLACK = 1.001  # an orthonormal basis's entries are within ±1; fp16 rounding stays within this


class LowRankCodec(Codec):
    """The frame's top-``rank`` principal directions in fp16 and int8 coordinates per token."""

    def __init__(self, rank: int) -> None:
        if rank not in _CODEC_IDS:
            raise ValueError(f"low-rank codecs have rank 16 or 32, got {rank}")
        self.rank, self.name, self.codec_id = rank, f"lowrank{rank}", _CODEC_IDS[rank]

    def frame_rank(self, x_shape: tuple[int, ...]) -> int:
        return min(self.rank, x_shape[-1], math.prod(x_shape[:-1]))

    def payload_bytes(self, x_shape: tuple[int, ...]) -> int:
        r, d, n = self.frame_rank(x_shape), x_shape[-1], math.prod(x_shape[:-1])
        return _META.size + 2 * d * r + _COORDS.payload_bytes((n, r))

    def pack_parts(self, x: torch.Tensor, tokens: torch.Tensor | None, *, saturate: bool = False) -> Packed:
        if x.ndim == 0:
            raise ValueError(f"{self.name} codes tokens (rows of the last dim); got a 0-dim tensor")
        r = self.frame_rank(tuple(x.shape))
        x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).float()  # (N, d)
        cov = x2.double().T @ x2.double()  # (d, d): float64, so the basis is the same wherever it is computed
        if r and bool(torch.isfinite(cov).all()):
            basis = torch.linalg.eigh(cov).eigenvectors[:, -r:].flip(1).float()  # (d, r), largest first
        else:  # a non-finite tensor is refused by the coordinates' checks
            basis = torch.eye(x2.shape[1], r, device=x2.device)
        coords = _COORDS.pack_parts(x2 @ basis, None)
        meta = (_META.pack(r), *coords.meta)
        return Packed(meta=meta, body=(basis.half(), *coords.body), source=x, checks=coords.checks)

    def validate(self, packed: Packed, checks: list[float]) -> bool:
        return _COORDS.validate(packed, checks)

    def unpack(self, frame: Frame, body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not frame.shape or len(frame.meta) != _META.size + 4:
            raise ShapeMismatch(
                f"{self.name} frame needs ≥ 1 dim and {_META.size + 4} meta bytes, got shape {frame.shape}, "
                f"{len(frame.meta)} meta bytes"
            )
        (r,) = _META.unpack_from(frame.meta)
        d, n = frame.shape[-1], math.prod(frame.shape[:-1])
        if r != self.frame_rank(frame.shape):
            raise ShapeMismatch(
                f"{self.name} frame of shape {frame.shape} declares rank {r}, not {self.frame_rank(frame.shape)}"
            )
        basis = from_bytes(body[: 2 * d * r], torch.float16, d * r, f"{self.name} basis").float().reshape(d, r)
        if d * r and not float(basis.abs().max()) <= BASIS_SLACK:  # (NaN fails too)
            raise MalformedFrame(f"{self.name} frame's basis has entries outside [-1, 1] (or NaN): not orthonormal")
        inner = replace(
            frame, codec_id=_COORDS.codec_id, dtype=torch.float32, shape=(n, r), meta=frame.meta[_META.size :]
        )
        coords, _ = _COORDS.unpack(inner, body[2 * d * r :])
        return (coords @ basis.T).reshape(frame.shape), None


LOWRANK_CODECS: dict[str, Codec] = {c.name: c for c in (LowRankCodec(16), LowRankCodec(32))}
_LOW_BIT.update(LOWRANK_CODECS)  # ``get_codec``'s
