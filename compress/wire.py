"""The one framed message format for every tensor payload on the wire.

A frame is a fixed header (magic ``SWLC``, version, codec, dtype, flags, shape, sizes, crc32), a codec's small
``meta`` and its body, zstd-compressed when that makes it 10% smaller. Decoding bounds every declared size by
``WireLimits`` (and an ``expected_shape``) before it allocates; layout and reasons: docs/architecture.md, compress/.

    >>> frame = decode_frame(encode_frame(CodecId.FP32, b"\\0" * 8, dtype=torch.float32, shape=(2,)))
"""

from __future__ import annotations

import math
import struct
import threading
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import torch
import zstandard

from compress.errors import (
    BadMagic,
    ChecksumMismatch,
    LimitExceeded,
    MalformedFrame,
    ShapeMismatch,
    TruncatedFrame,
    UnsupportedVersion,
)

MAGIC = b"SWLC"
VERSION = 1
_HEADER = struct.Struct("<4sBBBBBIIII")  # the fields of _Header
_CRC_OFFSET = _HEADER.size - 4
_FLAG_ZSTD = 1
ZSTD_LEVEL = 1  # cheap; level 3 shrinks SparseLoCo's index planes by under 1%
# A body zstd shrinks by less than this is sent raw: a raw body is decoded as a view of the received frame, while a
# compressed one costs a second buffer (a dense whole-stage outer payload would be held twice to save its names) and
# the receiver's decompression (~7 ms for an int8 microbatch of 8 x 1024 x 768 at 125m: the embedding's gradient,
# which zstd shrinks by only 8%, goes raw; the activations shrink by 40-95%: scripts/bench_wire_zstd.py). Frames
# either way decode alike: the flag says which.
ZSTD_MIN_SAVING = 0.10
# A round's outer payload (``min_saving``) crosses the WAN once per round, off the microbatch's path: 1% of its bytes
# is worth the decompression.
PAYLOAD_MIN_SAVING = 0.01

BytesLike = bytes | bytearray | memoryview  # a frame as received: a view into a larger buffer is never copied


class _Header(NamedTuple):
    magic: bytes
    version: int
    codec_id: int
    dtype_code: int
    flags: int
    ndim: int
    meta_len: int
    body_len: int
    payload_len: int
    crc: int


def _read_header(data: BytesLike) -> _Header:
    return _Header._make(_HEADER.unpack_from(data))


# wire code of a tensor dtype = its position here (never reorder: old frames depend on it)
DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


class CodecId(IntEnum):
    """Codec ids on the wire, for every codec in the package (one table so ids never collide)."""

    FP32 = 1
    FP16 = 2
    BF16 = 3
    INT8 = 4
    INT4 = 5
    SUBSPACE = 6  # activations: k values per token + token ids; meta names the inner codec
    SUBSPACE_GRAD = 7  # activation-gradients: the k-dim projection Uᵀg only
    SPARSELOCO = 8
    OUTER_PAYLOAD = 9  # a replica's whole pseudo-gradient for one round: its parameters' frames, one zstd stream
    ROT4 = 10  # randomized Hadamard rotation, then 4, 2 or 1 bits per value (compress/rotated.py)
    ROT2 = 11
    ROT1 = 12
    LOWRANK16 = 13  # the frame's own top-r principal directions + int8 coordinates (compress/lowrank.py)
    LOWRANK32 = 14


@dataclass(kw_only=True)
class WireLimits:
    """What a receiver is willing to allocate for one frame, and the largest |value| it takes from one.

    The defaults bound a receiver that knows nothing of the tensor it expects; every receiver of
    the swarm's own traffic knows more (``expected_shape``, the stage server's limits) and is
    tighter. 64 MiB holds a microbatch of 16 × 1024 tokens of width 1024 in fp32. ``max_abs`` is
    checked on the decoded tensor (``compress.codec_base``; by default only finiteness).
    """

    max_frame_bytes: int = 64 << 20  # the encoded frame as received
    max_body_bytes: int = 64 << 20  # the body after decompression
    max_meta_bytes: int = 64 << 10
    max_elements: int = 16 << 20  # elements of the declared tensor shape
    max_ndim: int = 8
    max_abs: float = math.inf  # of a decoded value (compress/codec_base.py, BOUNDARY_MAX_ABS)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"WireLimits.{name} must be positive, got {value}")
        if self.max_ndim > 255:
            raise ValueError(f"WireLimits.max_ndim is at most 255 (one header byte), got {self.max_ndim}")

    def tightest(self, other: WireLimits) -> WireLimits:
        """Each bound the smaller of the two."""
        return WireLimits(**{name: min(value, getattr(other, name)) for name, value in vars(self).items()})

    @classmethod
    def for_shape(cls, shape: tuple[int, ...], *, body_bytes: int, meta_bytes: int) -> WireLimits:
        """The bounds of a frame of exactly ``shape`` whose codec needs at most ``body_bytes`` and ``meta_bytes``."""
        return cls(
            max_frame_bytes=header_bytes(len(shape)) + meta_bytes + body_bytes + 1,
            max_body_bytes=max(1, body_bytes),
            max_meta_bytes=max(1, meta_bytes),
            max_elements=max(1, math.prod(shape)),
            max_ndim=min(255, max(1, len(shape))),
        )


DEFAULT_LIMITS = WireLimits()


def receiver_limits(limits: WireLimits | None, shape_limits: WireLimits | None) -> WireLimits:
    """The bounds a decode applies: ``limits`` (``DEFAULT_LIMITS`` if None), or those of the expected shape when the
    receiver knows it (tightened by ``limits`` when both are given)."""
    if shape_limits is None:
        return limits or DEFAULT_LIMITS
    return shape_limits if limits is None else limits.tightest(shape_limits)


@dataclass(frozen=True, kw_only=True)
class Frame:
    codec_id: int
    dtype: torch.dtype  # dtype of the tensor the sender encoded
    shape: tuple[int, ...]
    meta: bytes
    body: bytes | memoryview  # decompressed; a view of the received frame where it was sent raw

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def header_bytes(ndim: int) -> int:
    """Frame bytes around the meta and payload of an ``ndim``-dim tensor."""
    return _HEADER.size + 4 * ndim


def min_saving(codec_id: int) -> float:
    """The share of a frame's body zstd must save for the body to be sent compressed."""
    return PAYLOAD_MIN_SAVING if codec_id == CodecId.OUTER_PAYLOAD else ZSTD_MIN_SAVING


def zstd_pays(raw_bytes: int, compressed_bytes: int, saving: float = ZSTD_MIN_SAVING) -> bool:
    """Whether a body zstd coded from ``raw_bytes`` into ``compressed_bytes`` saves ``saving`` of it."""
    return compressed_bytes <= raw_bytes * (1 - saving)


def encode_frame(
    codec_id: int,
    body: bytes,
    *,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    meta: bytes = b"",
    compress: bool = True,
) -> bytes:
    """Wrap a codec body into a checksummed frame; zstd-compress the body where that saves enough of it
    (``min_saving``), unless ``compress`` is off (a sender that knows zstd does not pay for its frames)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be sent; supported: {', '.join(map(str, DTYPES))}")
    if len(shape) > 255 or any(not 0 <= n < 2**32 for n in shape):
        raise ValueError(f"shape {shape} cannot be framed: at most 255 dims, each in [0, 2**32)")
    if not 0 <= codec_id < 256 or max(len(meta), len(body)) >= 2**32:
        raise ValueError(f"codec id {codec_id} or sizes (meta {len(meta)}, body {len(body)}) out of range")
    payload = _compressed(body, min_saving(codec_id)) if compress else None
    flags = 0 if payload is None else _FLAG_ZSTD
    tail = struct.pack(f"<{len(shape)}I", *shape) + meta
    sent = body if payload is None else payload
    header = _HEADER.pack(
        MAGIC, VERSION, codec_id, DTYPES.index(dtype), flags, len(shape), len(meta), len(body), len(sent), 0
    )
    crc = zlib.crc32(sent, zlib.crc32(tail, zlib.crc32(header[:_CRC_OFFSET])))
    return b"".join((header[:_CRC_OFFSET], struct.pack("<I", crc), tail, sent))


def _compressed(body: bytes, saving: float) -> bytes | None:
    """``body`` zstd-compressed, or None where that does not pay. (Not judged from samples of the body: an int8
    activation's repeats are far apart, and 4 × 64 KiB of one zstd shrinks to 0.59 shrink to 0.92.)"""
    payload = _zstd.compressor.compress(body)
    return payload if zstd_pays(len(body), len(payload), saving) else None


def frame_codec_id(data: BytesLike) -> int | None:
    """The codec id a frame's header declares, read without decoding anything; None where there is no header to read
    (``decode_frame`` then says what is wrong)."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < _HEADER.size or bytes(data[:4]) != MAGIC:
        return None
    return memoryview(data).cast("B")[5]


def raw_frame_bytes(data: BytesLike) -> int | None:
    """The bytes of a frame like this one (same codec, shape and metadata) with its body stored raw, from the header
    alone: the most a reply coded like this request can take, which decides how the reply travels. None where there is
    no header to read.

    >>> raw_frame_bytes(encode_frame(CodecId.INT8, bytes(1 << 20), dtype=torch.float32, shape=(1 << 20,)))  # 1048605
    """
    if frame_codec_id(data) is None:
        return None
    header = _read_header(data)
    return header_bytes(header.ndim) + header.meta_len + header.body_len


def decode_frame(
    data: BytesLike, *, limits: WireLimits = DEFAULT_LIMITS, expected_shape: tuple[int, ...] | None = None
) -> Frame:
    """Parse and validate a frame; one of another shape than ``expected_shape`` is refused from its header, before
    anything is decompressed. Raises only ``WireError`` subclasses, whatever ``data`` holds."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedFrame(f"a frame is bytes, got {type(data).__name__}")
    data = memoryview(data).cast("B")
    if len(data) < len(MAGIC):
        raise TruncatedFrame(f"frame of {len(data)} bytes is shorter than its magic")
    if bytes(data[:4]) != MAGIC:
        raise BadMagic(f"not a swarmloco frame: starts with {bytes(data[:4])!r}, expected {MAGIC!r}")
    if len(data) < _HEADER.size:
        raise TruncatedFrame(f"frame of {len(data)} bytes is shorter than the {_HEADER.size}-byte header")
    _, version, codec_id, dtype_code, flags, ndim, meta_len, body_len, payload_len, crc = _read_header(data)
    if version != VERSION:
        raise UnsupportedVersion(f"frame format version {version}; this build reads version {VERSION}")
    if dtype_code >= len(DTYPES):
        raise MalformedFrame(f"unknown dtype code {dtype_code}")
    if flags & ~_FLAG_ZSTD:
        raise MalformedFrame(f"unknown flag bits {flags:#04x}")
    if ndim > limits.max_ndim:
        raise LimitExceeded(f"tensor of {ndim} dims is over the limit of {limits.max_ndim}")
    shape_end = header_bytes(ndim)
    if len(data) < shape_end:
        raise TruncatedFrame(f"frame of {len(data)} bytes ends inside its shape field")
    shape = struct.unpack_from(f"<{ndim}I", data, _HEADER.size)
    if expected_shape is not None and shape != tuple(expected_shape):
        raise ShapeMismatch(f"frame declares shape {shape}, the receiver expects {tuple(expected_shape)}")
    if len(data) > limits.max_frame_bytes:  # (the header read so far is bounded by max_ndim)
        raise LimitExceeded(f"frame of {len(data)} bytes is over the limit of {limits.max_frame_bytes}")
    if math.prod(shape) > limits.max_elements:
        raise LimitExceeded(f"shape {shape} has {math.prod(shape)} elements, over the limit of {limits.max_elements}")
    if meta_len > limits.max_meta_bytes:
        raise LimitExceeded(f"metadata of {meta_len} bytes is over the limit of {limits.max_meta_bytes}")
    if body_len > limits.max_body_bytes:
        raise LimitExceeded(f"body of {body_len} bytes is over the limit of {limits.max_body_bytes}")
    total = shape_end + meta_len + payload_len
    if len(data) < total:
        raise TruncatedFrame(f"frame of {len(data)} bytes is shorter than the {total} its header declares")
    if len(data) > total:
        raise ShapeMismatch(f"frame of {len(data)} bytes is longer than the {total} its header declares")
    if zlib.crc32(data[_CRC_OFFSET + 4 :], zlib.crc32(data[:_CRC_OFFSET])) != crc:
        raise ChecksumMismatch("frame checksum does not match its contents")
    payload = data[shape_end + meta_len :]  # a view: a raw body is not copied
    body = _decompress(payload, body_len) if flags & _FLAG_ZSTD else payload
    if len(body) != body_len:
        raise ShapeMismatch(f"body holds {len(body)} bytes, header declares {body_len}")
    return Frame(
        codec_id=codec_id,
        dtype=DTYPES[dtype_code],
        shape=shape,
        meta=bytes(data[shape_end : shape_end + meta_len]),
        body=body,
    )


class _ZstdContexts(threading.local):
    """This thread's zstd contexts (made once in each thread that codes): making one costs ~20 µs, more than coding a small frame,
    and a context must not be used by two threads at once."""

    def __init__(self) -> None:
        self.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self.decompressor = zstandard.ZstdDecompressor()


_zstd = _ZstdContexts()


def _decompress(payload: bytes | memoryview, body_len: int) -> bytes:
    # The zstd frame must declare its size; one-shot decompression then allocates exactly that
    # (already bounded) size and fails if the content would be larger.
    try:
        if zstandard.frame_content_size(payload) != body_len:
            raise ShapeMismatch(f"zstd body declares a size other than the header's {body_len} bytes")
        return _zstd.decompressor.decompress(payload, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise MalformedFrame(f"body does not decompress: {e}") from None
