"""The wire frame: round trips, one documented error per defect, bounded decoding, fuzzing."""

from __future__ import annotations

import math
import struct
import tracemalloc
import zlib

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from compress.errors import (
    BadMagic,
    ChecksumMismatch,
    LimitExceeded,
    MalformedFrame,
    ShapeMismatch,
    TruncatedFrame,
    UnsupportedVersion,
    WireError,
)
from compress.wire import (
    DEFAULT_LIMITS,
    MAGIC,
    VERSION,
    CodecId,
    WireLimits,
    decode_frame,
    encode_frame,
    receiver_limits,
)

HEADER = struct.Struct("<4sBBBBBIIII")  # the layout documented in compress/wire.py


def forge(
    *,
    version: int = VERSION,
    codec: int = CodecId.FP32,
    dtype: int = 0,
    flags: int = 0,
    shape: tuple[int, ...] = (2,),
    meta: bytes = b"",
    payload: bytes = b"\0" * 8,
    body_len: int | None = None,
) -> bytes:
    """A frame with a valid checksum but any header fields: reaches the checks after the crc."""
    tail = struct.pack(f"<{len(shape)}I", *shape) + meta
    body_len = len(payload) if body_len is None else body_len
    head = HEADER.pack(MAGIC, version, codec, dtype, flags, len(shape), len(meta), body_len, len(payload), 0)[:-4]
    crc = zlib.crc32(payload, zlib.crc32(tail, zlib.crc32(head)))
    return head + struct.pack("<I", crc) + tail + payload


def test_round_trip_raw_and_compressed() -> None:
    for body in (bytes(range(256)) * 3, b"\0" * 5000, b""):  # incompressible, compressible, empty
        data = encode_frame(CodecId.INT8, body, dtype=torch.bfloat16, shape=(3, 0, 7), meta=b"meta")
        frame = decode_frame(data)
        assert (frame.codec_id, frame.dtype, frame.shape, frame.meta, frame.body) == (
            CodecId.INT8,
            torch.bfloat16,
            (3, 0, 7),
            b"meta",
            body,
        )
    assert len(encode_frame(1, b"\0" * 5000, dtype=torch.float32, shape=(1250,))) < 100  # zstd used when it helps


def test_every_prefix_is_truncated() -> None:
    data = encode_frame(CodecId.FP16, b"x" * 40, dtype=torch.float16, shape=(4, 5), meta=b"m")
    for cut in range(len(data)):
        with pytest.raises(TruncatedFrame):
            decode_frame(data[:cut])


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (b"JUNKJUNKJUNKJUNKJUNKJUNKJUNKJUNK", BadMagic, "not a swarmloco frame"),
        (forge(version=VERSION + 1), UnsupportedVersion, "version"),
        (forge() + b"extra", ShapeMismatch, "longer than"),
        (forge(dtype=200), MalformedFrame, "dtype"),
        (forge(flags=0x80), MalformedFrame, "flag"),
        (forge(payload=b"\0" * 8, body_len=9), ShapeMismatch, "body holds 8 bytes"),
        (forge(flags=1, payload=b"not zstd at all", body_len=8), MalformedFrame, "decompress"),
        (forge(flags=1, payload=zstandard.compress(b"\0" * 100), body_len=8), ShapeMismatch, "zstd body declares"),
    ],
)
def test_each_defect_has_its_error(data: bytes, error: type[WireError], message: str) -> None:
    with pytest.raises(error, match=message):
        decode_frame(data)


def test_checksum_covers_header_shape_meta_and_payload() -> None:
    data = encode_frame(CodecId.INT8, b"payload!", dtype=torch.float32, shape=(2, 4), meta=b"mm")
    for pos in (5, 17, 26, len(data) - 9, len(data) - 1):  # codec id, body_len, shape, meta, payload
        broken = bytearray(data)
        broken[pos] ^= 0x01
        with pytest.raises(WireError):  # a length field may fail its own check before the crc
            decode_frame(bytes(broken))
    broken = bytearray(data)
    broken[-1] ^= 0xFF
    with pytest.raises(ChecksumMismatch):
        decode_frame(bytes(broken))


@pytest.mark.parametrize(
    ("limits", "data"),
    [
        (WireLimits(max_frame_bytes=100), forge(payload=b"\0" * 200)),
        (WireLimits(max_ndim=2), forge(shape=(1, 1, 1), payload=b"")),
        (WireLimits(max_elements=1000), forge(shape=(100, 11), payload=b"")),
        (WireLimits(max_meta_bytes=4), forge(meta=b"12345")),
        (WireLimits(max_body_bytes=1 << 20), forge(flags=1, payload=b"tiny", body_len=1 << 30)),
    ],
)
def test_sizes_over_limits(limits: WireLimits, data: bytes) -> None:
    with pytest.raises(LimitExceeded):
        decode_frame(data, limits=limits)


def test_declared_sizes_are_checked_before_allocating() -> None:
    huge = forge(shape=(2**31, 2**31), payload=b"")  # 4.6e18 elements declared, nothing sent
    with pytest.raises(LimitExceeded, match="elements"):
        decode_frame(huge)


def test_decompression_bomb_is_refused_without_expanding() -> None:
    bomb = zstandard.compress(b"\0" * (64 << 20))  # ~2 KiB that inflate to 64 MiB
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20))
    lying = bytearray(zstandard.compress(b"\0" * (1 << 20)))
    lying[5:9] = struct.pack("<I", 1000)  # zstd header now claims 1000 bytes; the content is 1 MiB
    tracemalloc.start()
    try:
        for payload, body_len in ((bomb, 1000), (no_size, 1000), (bytes(lying), 1000)):
            with pytest.raises((ShapeMismatch, MalformedFrame)):
                decode_frame(forge(flags=1, payload=payload, body_len=body_len, shape=(250,)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


def test_limits_validate_themselves() -> None:
    with pytest.raises(ValueError, match="max_elements"):
        WireLimits(max_elements=0)


def test_encode_rejects_what_it_cannot_frame() -> None:
    with pytest.raises(ValueError, match="dtype"):
        encode_frame(1, b"", dtype=torch.complex64, shape=(0,))
    with pytest.raises(ValueError, match="shape"):
        encode_frame(1, b"", dtype=torch.float32, shape=(-1,))


def _decodes_or_wire_error(data: bytes) -> None:
    try:
        decode_frame(data, limits=WireLimits(max_body_bytes=1 << 20, max_elements=1 << 20))
    except WireError:
        pass


@settings(deadline=None, max_examples=300)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decodes_or_wire_error(data)
    _decodes_or_wire_error(MAGIC + bytes([VERSION]) + data)  # past the magic and version checks


VALID = [
    encode_frame(CodecId.INT8, bytes(range(256)) * 2, dtype=torch.float32, shape=(4, 128), meta=b"abcd"),
    encode_frame(CodecId.FP32, b"\0" * 4096, dtype=torch.float32, shape=(32, 32)),
]


@settings(deadline=None, max_examples=300)
@given(
    st.sampled_from(VALID),
    st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 255), st.sampled_from(["set", "insert", "delete"])),
        min_size=1,
        max_size=4,
    ),
)
def test_fuzz_mutated_frames(data: bytes, edits: list[tuple[int, int, str]]) -> None:
    buf = bytearray(data)
    for pos, value, op in edits:
        pos %= len(buf) + 1
        if op == "insert":
            buf.insert(pos, value)
        elif pos < len(buf):
            if op == "set":
                buf[pos] = value
            else:
                del buf[pos]
    _decodes_or_wire_error(bytes(buf))


def test_a_receivers_value_bound_is_positive_and_the_tighter_of_two_wins() -> None:
    assert DEFAULT_LIMITS.max_abs == math.inf  # by default only finiteness (compress/codec_base.py checks values)
    assert WireLimits(max_abs=1e19).tightest(DEFAULT_LIMITS).max_abs == 1e19
    assert (
        receiver_limits(WireLimits(max_abs=5.0), WireLimits.for_shape((2,), body_bytes=8, meta_bytes=0)).max_abs == 5.0
    )
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="max_abs"):
            WireLimits(max_abs=bad)
