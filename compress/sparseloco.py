"""SparseLoCo pseudo-gradient codec: error feedback, chunked top-k, 2-bit values, compact indices.

Per tensor and round the error buffer takes Δ, its top-k magnitudes per 64×64 tile (or run of 64) are sent in 2
bits each with a (±a, ±b) code per scale group, and what was sent leaves the buffer. The frame body's layout,
the measured errors and index costs: docs/architecture.md, compress/.

    >>> frame = SparseLoCoCodec(topk=64).encode(name, delta, state)  # state: codec.new_state(), kept per replica
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from compress.errors import MalformedFrame, NonFiniteValues, ShapeMismatch, UnknownCodec
from compress.transfer import to_host
from compress.wire import BytesLike, CodecId, WireLimits, decode_frame, encode_frame, receiver_limits

_META = struct.Struct("<HH")  # topk, tile side
_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)


@dataclass(frozen=True)
class SparseTensor:
    indices: torch.Tensor  # (M,) int64 flat indices into the tensor, unique
    values: torch.Tensor  # (M,) float32
    shape: tuple[int, ...]

    def to_dense(self) -> torch.Tensor:
        return torch.zeros(math.prod(self.shape)).index_put_((self.indices,), self.values).view(self.shape)


@dataclass
class SparseLoCoState:
    """Error-feedback buffers by tensor name (float32, the tensor's shape); kept by the caller."""

    errors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class _Tiling:
    """A tensor as a (rows, cols) matrix cut into (th, tw) chunks, k values sent per chunk.

    The per-chunk arrays are small (C×k), where torch's per-op overhead would dominate: they
    are numpy arrays, viewing the same memory as the torch tensors at the edges.
    """

    rows: int
    cols: int
    th: int
    tw: int
    k: int
    chunks_per_group: int  # consecutive chunks sharing one (a, b) pair

    @classmethod
    @functools.lru_cache(maxsize=1024)  # a handful of parameter shapes, coded every round; entries are a few ints
    def of(cls, shape: tuple[int, ...], tile: int, topk: int) -> _Tiling:
        if math.prod(shape) == 0:
            return cls(0, 0, tile, tile, topk, 1)
        if len(shape) >= 2:
            return cls(shape[0], math.prod(shape[1:]), tile, tile, topk, 1)
        # 1-D tensors (norm gains) are sent whole, in runs of 64: they are a few hundred values per stage, and
        # keeping 1.6% of them cost 1.5% validation loss for 4% of the bytes (docs/benchmarks.md, "the remaining levers")
        return cls(1, math.prod(shape), 1, tile, tile, tile)

    @functools.cached_property
    def grid(self) -> tuple[int, int]:
        return -(-self.rows // self.th), -(-self.cols // self.tw)

    @functools.cached_property
    def n_chunks(self) -> int:
        return self.grid[0] * self.grid[1]

    @functools.cached_property
    def n_groups(self) -> int:
        return -(-self.n_chunks // self.chunks_per_group)

    @functools.cached_property
    def body_bytes(self) -> int:
        """Index deltas (2 bytes each), 2-bit codes and a bf16 (a, b) pair per scale group."""
        m = self.n_chunks * self.k
        return 2 * m + -(-m // 4) + 4 * self.n_groups

    def magnitude_keys(self, x: np.ndarray) -> np.ndarray:
        """(rows·cols,) float32 → (n_chunks, th·tw) int32 keys that order like |x|.

        Non-negative floats order like their bit patterns, and numpy selects ints faster than
        floats. Padding gets distinct negative keys: it ranks last, without the ties that slow
        down introselect. A key ≥ 0x7F800000 is an inf or NaN.
        """
        (gr, gc), th, tw = self.grid, self.th, self.tw
        x = x.reshape(self.rows, self.cols)
        if x.shape == (gr * th, gc * tw):
            keys: np.ndarray = np.empty((gr, gc, th, tw), dtype=np.float32)  # float32 here, int32 bits below
            np.abs(x.reshape(gr, th, gc, tw).swapaxes(1, 2), out=keys)  # abs and tiling in one pass
        else:
            padded = -1 - np.arange(gr * th * gc * tw, dtype=np.int32).reshape(gr * th, gc * tw)
            np.abs(x, out=padded.view(np.float32)[: self.rows, : self.cols])
            keys = padded.reshape(gr, th, gc, tw).swapaxes(1, 2)
        return np.ascontiguousarray(keys).view(np.int32).reshape(self.n_chunks, th * tw)

    def flat_index(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray | slice]:
        """(n_chunks, k) chunk-local indices → flat tensor indices (0 in padding), and which are real
        elements: a mask, or ``slice(None)`` (all) when the tiles fit the tensor exactly."""
        chunk_row, chunk_col = np.divmod(np.arange(self.n_chunks)[:, None], self.grid[1])
        row = chunk_row * self.th + (local >> (self.tw.bit_length() - 1))  # tw is a power of two
        col = chunk_col * self.tw + (local & (self.tw - 1))
        if self.rows % self.th == 0 and self.cols % self.tw == 0:
            return row * self.cols + col, slice(None)
        real = (row < self.rows) & (col < self.cols)
        return np.where(real, row * self.cols + col, 0), real

    def grouped(self, x: np.ndarray) -> np.ndarray:
        """(n_chunks, k) → (n_groups, chunks_per_group·k), the last group zero-filled."""
        if len(x) != self.n_groups * self.chunks_per_group:
            x = _fill_into(np.zeros((self.n_groups * self.chunks_per_group, self.k), dtype=x.dtype), x)
        return x.reshape(self.n_groups, self.chunks_per_group * self.k)

    def per_chunk(self, x: np.ndarray) -> np.ndarray:
        """(n_groups, ...) → (n_chunks, ...): each group's row for each of its chunks."""
        return x if self.chunks_per_group == 1 else np.repeat(x, self.chunks_per_group, axis=0)[: self.n_chunks]


class SparseLoCoCodec:
    codec_id = CodecId.SPARSELOCO

    def __init__(self, *, topk: int = 64, chunk_size: int = 4096, error_decay: float = 0.95) -> None:
        self.tile = math.isqrt(chunk_size)
        if self.tile**2 != chunk_size or self.tile.bit_count() != 1 or self.tile > 256:
            raise ValueError(f"chunk_size must be a square power-of-two tile of at most 256×256, got {chunk_size}")
        if not 1 <= topk <= chunk_size:
            raise ValueError(f"topk must be in [1, {chunk_size}], got {topk}")
        if not 0.0 <= error_decay <= 1.0:
            raise ValueError(f"error_decay must be in [0, 1], got {error_decay}")
        self.topk, self.chunk_size, self.error_decay = topk, chunk_size, error_decay

    def new_state(self) -> SparseLoCoState:
        return SparseLoCoState()

    def limits_for(self, shape: tuple[int, ...]) -> WireLimits:
        """The bounds of a frame of ``shape``: its body has exactly the size the shape fixes."""
        return WireLimits.for_shape(
            shape, body_bytes=_Tiling.of(shape, self.tile, self.topk).body_bytes, meta_bytes=_META.size
        )

    def encode(self, name: str, delta: torch.Tensor, state: SparseLoCoState) -> bytes:
        """Fold ``delta`` into the error buffer of ``name``, send its top-k per chunk, keep the rest. Coded where
        ``delta`` lies (``codes_on_host``), its error buffer kept there: only the frame's body reaches the host."""
        delta = delta.detach().float()
        e = state.errors.get(name)
        if e is not None and e.shape != delta.shape:
            raise ValueError(
                f"pseudo-gradient {name!r} has shape {tuple(delta.shape)}, its error buffer {tuple(e.shape)}"
            )
        e = delta.clone() if e is None else torch.add(delta, e.to(delta.device), alpha=self.error_decay)  # β·e + Δ, new
        tiling = _Tiling.of(tuple(e.shape), self.tile, self.topk)
        body = _encode_on_host(e, tiling) if codes_on_host(e.device) else _encode_on_device(e, tiling)
        if body is None:
            raise ValueError(f"pseudo-gradient {name!r} holds NaN or inf values")
        state.errors[name] = e
        return encode_frame(
            self.codec_id, body, dtype=delta.dtype, shape=tuple(delta.shape), meta=_META.pack(self.topk, self.tile)
        )

    def decode(
        self,
        data: BytesLike,
        *,
        limits: WireLimits | None = None,
        allow_nonfinite: bool = False,
        expected_shape: tuple[int, ...] | None = None,
    ) -> SparseTensor:
        """The sent values of one tensor; ``expected_shape`` (the receiver's parameter) refuses a frame of another
        shape from its header and bounds its body by what that shape needs (``limits_for``), before any allocation."""
        shape_limits = None if expected_shape is None else self.limits_for(tuple(expected_shape))
        frame = decode_frame(data, limits=receiver_limits(limits, shape_limits), expected_shape=expected_shape)
        if frame.codec_id != self.codec_id:
            raise UnknownCodec(f"frame has codec id {frame.codec_id}, expected SparseLoCo (id {int(self.codec_id)})")
        if frame.meta != _META.pack(self.topk, self.tile):
            raise ShapeMismatch(
                f"frame was coded with meta {frame.meta.hex()} (topk, tile), this codec uses ({self.topk}, {self.tile})"
            )
        tiling = _Tiling.of(frame.shape, self.tile, self.topk)
        m, n_groups = tiling.n_chunks * tiling.k, tiling.n_groups
        n_codes = -(-m // 4)
        if len(frame.body) != tiling.body_bytes:
            raise ShapeMismatch(
                f"SparseLoCo body holds {len(frame.body)} bytes; shape {frame.shape} needs {tiling.body_bytes}"
            )
        planes = np.frombuffer(frame.body, np.uint8, 2 * m).reshape(2, m)
        deltas = (planes[0] | planes[1].astype(np.int64) << 8).reshape(tiling.n_chunks, tiling.k)
        if (deltas[:, 1:] == 0).any():
            raise MalformedFrame("indices within a chunk are not strictly increasing")
        local = np.cumsum(deltas, axis=1)
        if m and local[:, -1].max() >= tiling.th * tiling.tw:
            raise MalformedFrame(f"chunk-local index beyond the chunk size {tiling.th * tiling.tw}")
        codes = _unpack2(np.frombuffer(frame.body, np.uint8, n_codes, 2 * m), m).reshape(local.shape)
        levels = _from_bf16(np.frombuffer(frame.body, "<u2", 2 * n_groups, 2 * m + n_codes).reshape(n_groups, 2))
        if not allow_nonfinite and not np.isfinite(levels).all():
            raise NonFiniteValues("SparseLoCo frame carries NaN or inf value scales")
        flat, real = tiling.flat_index(local)
        values = _dequantize(codes, tiling.per_chunk(levels))
        return SparseTensor(torch.from_numpy(flat[real].ravel()), torch.from_numpy(values[real].ravel()), frame.shape)


def codes_on_host(device: torch.device) -> bool:
    """Whether a pseudo-gradient on ``device`` is coded with numpy (the CPU's: its per-chunk arrays are small, where
    torch's per-op overhead dominates) rather than with torch where it lies (``_encode_on_device``)."""
    return device.type == "cpu"


def _encode_on_host(e: torch.Tensor, tiling: _Tiling) -> bytes | None:
    """The frame body of error buffer ``e`` (a CPU tensor), which loses what is sent; None if it holds NaN or inf."""
    err = e.numpy().reshape(-1)  # a view of e
    keys = tiling.magnitude_keys(err)  # (C, L)
    if keys.size and keys.max() >= 0x7F800000:
        return None
    local = _top_k(keys, tiling.k)  # (C, k)
    flat, real = tiling.flat_index(local)
    values = err[flat] if isinstance(real, slice) else np.where(real, err[flat], 0)  # padding picks carry 0
    codes, levels = _quantize(values, tiling)
    err[flat[real]] -= _dequantize(codes, tiling.per_chunk(_from_bf16(levels)))[real]  # e ← e − decoded(sent)
    deltas = local.astype("<u2")  # < 2**16: tiles are at most 256×256; the first of a chunk counts from 0
    deltas[:, 1:] = np.diff(local, axis=1)
    return b"".join((deltas.view(np.uint8).reshape(-1, 2).T.tobytes(), _pack2(codes).tobytes(), levels.tobytes()))


def _encode_on_device(e: torch.Tensor, tiling: _Tiling) -> bytes | None:
    """``_encode_on_host`` in torch ops where ``e`` lies: the same body (which of equal magnitudes a chunk keeps
    aside), of which only the bytes cross to the host, with the check of ``e``'s values, in one copy."""
    if e.numel() == 0:
        return b""
    (gr, gc), th, tw, k = tiling.grid, tiling.th, tiling.tw, tiling.k
    # keys that order like |e|, as on the host: fp32 bits, padding distinct and negative
    keys = -1 - torch.arange(gr * th * gc * tw, dtype=torch.int32, device=e.device).reshape(gr * th, gc * tw)
    keys[: tiling.rows, : tiling.cols] = e.reshape(tiling.rows, tiling.cols).abs().view(torch.int32)
    keys = keys.reshape(gr, th, gc, tw).transpose(1, 2).reshape(tiling.n_chunks, th * tw)
    # ties broken towards the first column, as ``_top_k`` does: keys made distinct, in the same order otherwise
    ranked = keys.long() * 65536 + (65535 - torch.arange(th * tw, device=e.device))  # th·tw ≤ 65536
    local = torch.topk(ranked, k, dim=1, sorted=False).indices.sort(dim=1).values  # (C, k)
    chunk = torch.arange(tiling.n_chunks, device=e.device)[:, None]
    row = chunk // gc * th + (local >> (tw.bit_length() - 1))
    col = chunk % gc * tw + (local & (tw - 1))
    real = (row < tiling.rows) & (col < tiling.cols)
    flat, err = torch.where(real, row * tiling.cols + col, 0), e.view(-1)
    values = torch.where(real, err[flat], 0.0)  # padding picks carry 0
    codes, levels = _quantize_on_device(values, tiling)
    table = levels.repeat_interleave(tiling.chunks_per_group, 0)[: tiling.n_chunks]
    sent = torch.cat((table, -table), dim=1).gather(1, codes.long())  # as the receiver decodes it
    err[flat[real]] -= sent[real]  # e ← e − decoded(sent)
    deltas = torch.cat((local[:, :1], local.diff(dim=1)), dim=1)
    planes = torch.stack((deltas & 255, deltas >> 8)).to(torch.uint8)  # the low bytes of every index, then the high
    quads = F.pad(codes.reshape(-1), (0, -codes.numel() % 4)).reshape(-1, 4)
    packed = quads[:, 0] | quads[:, 1] << 2 | quads[:, 2] << 4 | quads[:, 3] << 6
    bits = levels.view(torch.int32) >> 16 & 0xFFFF  # bf16, truncated, little-endian
    body, largest = to_host([(planes, packed, torch.stack((bits & 255, bits >> 8), -1).to(torch.uint8)), (keys.max(),)])
    return None if int.from_bytes(largest, "little", signed=True) >= 0x7F800000 else body


def _quantize_on_device(values: torch.Tensor, tiling: _Tiling) -> tuple[torch.Tensor, torch.Tensor]:
    """``_quantize`` in torch: (C, k) uint8 codes and (G, 2) float32 levels, already truncated to bf16."""
    groups = tiling.n_groups * tiling.chunks_per_group
    mag = F.pad(values.abs(), (0, 0, 0, groups - len(values))).reshape(tiling.n_groups, -1)  # (G, S)
    counted = torch.full((len(mag),), mag.shape[1], dtype=torch.float64, device=values.device)
    counted[-1] -= mag.numel() - values.numel()  # the fill of the last group is counted in no mean
    total = mag.sum(dim=1, dtype=torch.float64)
    big = mag.double() * counted[:, None] > total[:, None]
    n_big, big_total = big.sum(dim=1), (mag * big).sum(dim=1, dtype=torch.float64)
    small_mean = (total - big_total) / (counted - n_big).clamp(min=1)
    levels = torch.stack((small_mean, big_total / n_big.clamp(min=1)), dim=1).float()
    codes = big.reshape(-1, tiling.k)[: len(values)].to(torch.uint8) + 2 * torch.signbit(values).to(torch.uint8)
    return codes, (levels.view(torch.int32) & -65536).view(torch.float32)


def aggregate_mean(parts: list[SparseTensor]) -> torch.Tensor:
    """Dense mean per index over the replicas that sent that index (0 where none did)."""
    if not parts:
        raise ValueError("aggregate_mean needs at least one part")
    shape = parts[0].shape
    if any(p.shape != shape for p in parts):
        raise ValueError(f"all parts must have the same shape, got {sorted({p.shape for p in parts})}")
    total, count = torch.zeros(math.prod(shape)), torch.zeros(math.prod(shape))
    for p in parts:
        total.index_add_(0, p.indices, p.values)
        count.index_add_(0, p.indices, torch.ones_like(p.values))
    return (total / count.clamp(min=1)).view(shape)


def _top_k(keys: np.ndarray, k: int) -> np.ndarray:
    """(C, L) → (C, k): the columns of each row's k largest keys, ascending.

    Finding each row's k-th key and masking (np.partition + np.flatnonzero) is ~2× faster than
    np.argpartition and yields sorted positions. Ties at a k-th key (a Δ of weights that moved by
    the same few ulps) keep the first columns among them, as ``_encode_on_device`` does.
    """
    width = keys.shape[1]
    kth = np.partition(keys, width - k, axis=1)[:, width - k, None]
    take = keys >= kth
    if take.sum() != len(keys) * k:
        ties = keys == kth
        take = (keys > kth) | (ties & (np.cumsum(ties, axis=1) <= k - (keys > kth).sum(axis=1, keepdims=True)))
    columns: np.ndarray = (np.flatnonzero(take) % width).reshape(-1, k)  # (numpy types these as Any)
    return columns


def _fill_into(out: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``x`` written into the top-left corner of ``out`` (np.pad costs ~20 µs a call)."""
    out[tuple(slice(n) for n in x.shape)] = x
    return out


def _quantize(values: np.ndarray, tiling: _Tiling) -> tuple[np.ndarray, np.ndarray]:
    """(C, k) 2-bit codes and (G, 2) bf16 bits of the magnitudes (a, b) of each scale group.

    A value is "big" when its magnitude is above its group's mean; a and b are the mean
    magnitudes of the small and the big values. Code bit 1 = negative, bit 0 = big. Padding
    picks enter as zeros; only tiles with fewer than k elements have them. The zeros that fill
    the last group out to whole groups count in no mean: a 1-D tensor of 64 gains is one group
    of 64 values, not of 4096 mostly zeros (which made every gain "big" and a a near-zero level).
    """
    mag = tiling.grouped(np.abs(values))  # (G, S)
    counted = np.full(len(mag), mag.shape[1])  # values per group, the fill of the last one left out
    counted[-1:] -= mag.size - values.size
    total = mag.sum(axis=1, dtype=np.float64)  # in fp64: a sum of fp32 magnitudes near 3.4e38 overflows in fp32
    big = mag * counted[:, None] > total[:, None]
    n_big, levels = big.sum(axis=1), np.empty((len(mag), 2), dtype=np.float32)
    big_total = (mag * big).sum(axis=1, dtype=np.float64)
    levels[:, 0] = (total - big_total) / np.maximum(counted - n_big, 1)  # means of finite fp32 values: finite
    levels[:, 1] = big_total / np.maximum(n_big, 1)  # 0 when nothing is big, and then unused
    codes = big.reshape(-1, tiling.k)[: len(values)].view(np.uint8) + 2 * np.signbit(values).view(np.uint8)
    return codes, _to_bf16(levels)


def _dequantize(codes: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """(C, k) values from codes and (C, 2) float32 levels."""
    table = np.concatenate((levels, -levels), axis=1)  # (C, 4): code → value
    values: np.ndarray = table[np.arange(len(codes))[:, None], codes]  # (numpy types fancy indexing as Any)
    return values


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 → bf16 bit patterns, truncated: up to 0.8% low, which error feedback absorbs (the
    sender subtracts exactly what the receiver decodes)."""
    return (x.view(np.uint32) >> 16).astype("<u2")


def _from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _pack2(codes: np.ndarray) -> np.ndarray:
    flat = _fill_into(np.zeros(-(-codes.size // 4) * 4, np.uint8), codes.reshape(-1)).reshape(-1, 4)
    packed: np.ndarray = (flat << _SHIFTS).sum(axis=1, dtype=np.uint8)  # four codes per byte, the first in the low bits
    return packed


def _unpack2(packed: np.ndarray, m: int) -> np.ndarray:
    return ((packed[:, None] >> _SHIFTS) & 3).reshape(-1)[:m]
