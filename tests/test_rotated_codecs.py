"""Low-bit boundary codecs (compress/rotated.py, compress/lowrank.py) at real shapes: bounds, bytes, bad frames,
determinism."""

from __future__ import annotations

import math
import struct
import subprocess
import sys

import pytest
import torch

from compress.adaptive import Ladder
from compress.codecs import CODEC_NAMES, get_codec
from compress.config import CodecConfig
from compress.errors import LimitExceeded, MalformedFrame, ShapeMismatch, TruncatedFrame, UnknownCodec, WireError
from compress.lowrank import LOWRANK_CODECS
from compress.rotated import ROTATED_CODECS, ROTATIONS_KEPT, _rotation, block_size, rotate, unrotate
from compress.wire import decode_frame, encode_frame, header_bytes

SHAPE = (8, 1024, 768)  # a 125m microbatch: 8 sequences of 1024 tokens, d_model 768
NAMES = ("rot4", "rot2", "rot1")
LOWRANK = ("lowrank16", "lowrank32")
# Lloyd-Max on a unit Gaussian: relative error sqrt(MSE) = 0.0975, 0.343, 0.603; the scale's 4.4% grid adds a little
MAX_ERROR = {"rot4": 0.105, "rot2": 0.35, "rot1": 0.61}
MIN_RATIO = {"rot4": 7.9, "rot2": 15.7, "rot1": 31.5}  # fp32 bytes / frame bytes before zstd, at d = 768


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=g) * torch.rand(*SHAPE[:-1], 1, generator=g).add(0.1)  # rows of any scale


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_at_real_shape(name: str, x: torch.Tensor) -> None:
    codec = get_codec(name)
    frame = codec.encode(x)
    y = codec.decode(frame, expected_shape=SHAPE)
    assert y.shape == SHAPE and y.dtype == torch.float32
    assert rel_error(y, x) < MAX_ERROR[name]
    assert codec.estimated_ratio(SHAPE) >= MIN_RATIO[name]
    assert len(frame) <= 4 * x.numel() / MIN_RATIO[name]  # zstd only helps
    bits = 8 * codec.payload_bytes(SHAPE) / x.numel()
    assert bits == pytest.approx(int(name[3:]) + 8 / 768, abs=1e-4)  # the values, and one scale byte per token


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_without_the_host_agrees(name: str, x: torch.Tensor) -> None:
    codec = get_codec(name)
    y, nbytes = codec.round_trip(x[:1])
    frame = codec.encode(x[:1])
    assert torch.equal(y, codec.decode(frame))
    assert nbytes == header_bytes(3) + codec.payload_bytes(tuple(x[:1].shape))


def test_rotation_spreads_outliers_better_than_int4(x: torch.Tensor) -> None:
    """A residual stream's massive dimensions: int4's per-token absmax scale wastes its levels on them."""
    y = x[:1].clone()
    y[..., 7] *= 50
    assert rel_error(get_codec("rot4").decode(get_codec("rot4").encode(y)), y) < 0.5 * rel_error(
        get_codec("int4").decode(get_codec("int4").encode(y)), y
    )


@pytest.mark.parametrize("d", [768, 384, 128, 2048, 96, 13, 7, 1])
def test_rotation_is_orthonormal_at_any_width(d: int) -> None:
    rows = torch.randn(5, d, dtype=torch.float32)
    assert block_size(d) & (block_size(d) - 1) == 0 and d % block_size(d) == 0
    assert torch.allclose(rotate(rows).norm(dim=1), rows.norm(dim=1), rtol=1e-5)
    assert torch.allclose(unrotate(rotate(rows)), rows, atol=1e-5)
    for name in NAMES:  # widths that do not fill the last byte of packed codes
        codec = get_codec(name)
        assert rel_error(codec.decode(codec.encode(rows)), rows) < 1.0


@pytest.mark.parametrize("name", NAMES)
def test_zero_rows_decode_to_zero_and_dtypes_are_kept(name: str) -> None:
    codec = get_codec(name)
    x = torch.randn(4, 6, 64).to(torch.bfloat16)
    x[1, 2] = 0
    frame = codec.encode(x)
    assert decode_frame(frame).dtype == torch.bfloat16
    y = codec.decode(frame)
    assert torch.equal(y[1, 2], torch.zeros(64)) and bool(y[0].ne(0).any())
    assert torch.equal(codec.decode(codec.encode(torch.zeros(3, 64))), torch.zeros(3, 64))


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_inputs_are_refused_at_encode(name: str) -> None:
    x = torch.randn(4, 64)
    x[2, 3] = math.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        get_codec(name).encode(x)
    with pytest.raises(ValueError, match="so large"):
        get_codec(name).encode(torch.full((4, 256), 1e38))
    with pytest.raises(ValueError, match="0-dim"):
        get_codec(name).encode(torch.tensor(1.0))


def reframed(
    frame: bytes, *, meta: bytes | None = None, body: bytes | None = None, shape: tuple[int, ...] = ()
) -> bytes:
    f = decode_frame(frame)
    return encode_frame(
        f.codec_id,
        bytes(f.body) if body is None else body,
        dtype=f.dtype,
        shape=shape or f.shape,
        meta=f.meta if meta is None else meta,
    )


@pytest.mark.parametrize("name", NAMES)
def test_bad_frames_are_refused_with_a_clear_error(name: str, x: torch.Tensor) -> None:
    codec = get_codec(name)
    small = x[0, :64]  # (64, 768)
    frame = codec.encode(small)
    with pytest.raises(TruncatedFrame):
        codec.decode(frame[: len(frame) // 2])
    with pytest.raises(ShapeMismatch, match="receiver expects"):
        codec.decode(frame, expected_shape=(65, 768))
    with pytest.raises(ShapeMismatch, match="values"):  # a declared shape the body does not hold
        codec.decode(reframed(frame, shape=(64, 770)))
    with pytest.raises(ShapeMismatch, match="meta"):
        codec.decode(reframed(frame, meta=b"\0\0"))
    for bad in (math.nan, math.inf, -1.0, 0.0, 3e38):
        with pytest.raises(MalformedFrame, match="scale"):
            codec.decode(reframed(frame, meta=struct.pack("<f", bad)))
    with pytest.raises(UnknownCodec):
        get_codec("int4").decode(frame)


@pytest.mark.parametrize("name", NAMES)
def test_huge_declared_sizes_are_refused_before_allocating(name: str) -> None:
    codec = get_codec(name)
    frame = codec.encode(torch.randn(2, 768))
    huge = reframed(frame, shape=(1 << 20, 1 << 12))  # 4G elements declared
    with pytest.raises(LimitExceeded):
        codec.decode(huge)
    with pytest.raises(ShapeMismatch):
        codec.decode(huge, expected_shape=SHAPE)
    body = bytes(decode_frame(frame).body) + bytes(codec.payload_bytes(SHAPE))
    with pytest.raises(LimitExceeded, match="body"):  # more bytes than the expected shape needs in this codec
        codec.decode(reframed(frame, body=body, shape=SHAPE), expected_shape=SHAPE)


@pytest.mark.parametrize("name", (*NAMES, *LOWRANK))
@pytest.mark.parametrize("shape", [(0, 768), (2, 0, 768), (0, 0), (4, 0)])
def test_frames_without_tokens_or_width_decode_to_empty_tensors(name: str, shape: tuple[int, ...]) -> None:
    """A frame of no tokens (or width 0), encoded or sealed by hand with the body its shape needs, decodes to an empty
    tensor of its shape: a packed-code reshape once read n = 0 as ambiguous (a RuntimeError, not a WireError)."""
    codec = get_codec(name)
    assert codec.decode(codec.encode(torch.zeros(shape)), expected_shape=shape).shape == shape
    meta = decode_frame(codec.encode(torch.zeros(shape))).meta
    sealed = encode_frame(
        codec.codec_id, bytes(codec.payload_bytes(shape) - len(meta)), dtype=torch.float32, shape=shape, meta=meta
    )
    assert codec.decode(sealed).shape == shape


def test_the_widths_a_sender_declares_do_not_grow_the_receivers_memory() -> None:
    """A stage server decodes a request before it checks the width against the model's: each width a sender picks
    would keep its rotation (d signs and a Hadamard block) for good; only the last few widths are kept."""
    codec = get_codec("rot1")
    frame = decode_frame(codec.encode(torch.randn(1, 8)))
    for d in range(1, 4 * ROTATIONS_KEPT):
        sealed = encode_frame(
            codec.codec_id, bytes(1 + codec.row_bytes(d)), dtype=torch.float32, shape=(1, d), meta=frame.meta
        )
        assert codec.decode(sealed).shape == (1, d)
    assert _rotation.cache_info().currsize <= ROTATIONS_KEPT


def test_fuzzed_frames_raise_only_wire_errors() -> None:
    g = torch.Generator().manual_seed(1)
    for codec in (ROTATED_CODECS | LOWRANK_CODECS).values():
        frame = bytearray(codec.encode(torch.randn(3, 5, 96)))
        for i in torch.randint(0, len(frame), (200,), generator=g).tolist():
            broken = bytearray(frame)
            broken[i] ^= 0xFF
            try:
                codec.decode(bytes(broken))
            except WireError:
                pass


def test_encoding_is_deterministic_across_processes() -> None:
    """Signs and Hadamard blocks depend on d alone: another process (another global seed) codes alike."""
    sample = torch.randn(16, 768, generator=torch.Generator().manual_seed(5))
    for name in NAMES:
        assert get_codec(name).encode(sample) == get_codec(name).encode(sample.clone())
    script = (
        "import torch, sys; from compress.codecs import get_codec; torch.manual_seed(123); "
        "x = torch.randn(16, 768, generator=torch.Generator().manual_seed(5)); "
        f"sys.stdout.buffer.write(b''.join(get_codec(n).encode(x) for n in {NAMES!r}))"
    )
    there = subprocess.run([sys.executable, "-c", script], capture_output=True, check=True).stdout
    assert there == b"".join(get_codec(name).encode(sample) for name in NAMES)


def test_names_are_accepted_wherever_codecs_are_chosen() -> None:
    assert {*NAMES, *LOWRANK} <= set(CODEC_NAMES)
    assert CodecConfig(activations="rot2", gradients="rot1").gradients == "rot1"
    ladder = Ladder([get_codec(name) for name in ("int8", *NAMES, *LOWRANK)])
    x = torch.randn(2, 16, 128)
    for codec in ladder.codecs:
        used, y, _ = ladder.decode(codec.encode(x), expected_shape=tuple(x.shape))
        assert used is codec and y.shape == x.shape
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("rot3")


@pytest.fixture(scope="module")
def low_rank() -> torch.Tensor:
    """A microbatch whose tokens span 16 directions, plus 1% noise."""
    g = torch.Generator().manual_seed(2)
    spanned = torch.randn(*SHAPE[:-1], 16, generator=g) @ torch.randn(16, SHAPE[-1], generator=g)
    return spanned + 0.01 * torch.randn(SHAPE, generator=g)


@pytest.mark.slow  # (an eigendecomposition of 768 × 768 in float64 per frame: ~2 s a frame on this CPU)
@pytest.mark.parametrize("name", LOWRANK)
def test_lowrank_round_trip_at_real_shape(name: str, low_rank: torch.Tensor) -> None:
    codec = get_codec(name)
    frame = codec.encode(low_rank)
    assert frame == codec.encode(low_rank.clone())  # deterministic
    y = codec.decode(frame, expected_shape=SHAPE)
    assert rel_error(y, low_rank) < 0.01
    r = int(name[7:])
    assert codec.payload_bytes(SHAPE) == 2 + 2 * 768 * r + 4 + 8 * 1024 * (1 + r)  # basis, coordinates, scales
    assert codec.estimated_ratio(SHAPE) > {16: 150, 32: 78}[r]
    x = torch.randn(3, 8)  # fewer tokens or a narrower width than the rank: the frame's rank is what fits
    assert torch.allclose(codec.decode(codec.encode(x)), x, atol=0.02)


@pytest.mark.parametrize("name", LOWRANK)
def test_lowrank_bad_frames_are_refused(name: str, low_rank: torch.Tensor) -> None:
    codec = get_codec(name)
    small = low_rank[0, :64]  # (64, 768)
    frame = codec.encode(small)
    f = decode_frame(frame)
    r = int(name[7:])
    with pytest.raises(TruncatedFrame):
        codec.decode(frame[:-10])
    with pytest.raises(ShapeMismatch, match="rank"):
        codec.decode(reframed(frame, meta=struct.pack("<H", r - 1) + f.meta[2:]))
    with pytest.raises(ShapeMismatch, match="meta"):
        codec.decode(reframed(frame, meta=f.meta[:2]))
    nan_basis = struct.pack("<e", math.nan) + bytes(f.body)[2:]
    with pytest.raises(MalformedFrame, match="basis"):
        codec.decode(reframed(frame, body=nan_basis))
    big_basis = struct.pack("<e", 2.0) + bytes(f.body)[2:]
    with pytest.raises(MalformedFrame, match="basis"):
        codec.decode(reframed(frame, body=big_basis))
    with pytest.raises(MalformedFrame, match="scale"):
        codec.decode(reframed(frame, meta=f.meta[:2] + struct.pack("<f", math.nan)))
    with pytest.raises(ShapeMismatch):
        codec.decode(reframed(frame, shape=(64, 769)))
    with pytest.raises(LimitExceeded):
        codec.decode(reframed(frame, shape=(1 << 20, 1 << 12)))
    x = small.clone()
    x[3, 3] = math.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        codec.encode(x)
