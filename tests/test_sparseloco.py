"""SparseLoCo: error feedback, tiled top-k, 2-bit values, index coding, aggregation, hostile frames."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from compress.errors import MalformedFrame, NonFiniteValues, ShapeMismatch, UnknownCodec, WireError
from compress.sparseloco import SparseLoCoCodec, SparseTensor, aggregate_mean
from compress.wire import CodecId, WireLimits, decode_frame, encode_frame

torch.manual_seed(0)
CODEC = SparseLoCoCodec(topk=64, chunk_size=4096, error_decay=0.95)


def tiles(x: torch.Tensor) -> torch.Tensor:
    """Reference 64×64 tiling of a 2-D tensor, edge tiles zero-padded: (n_tiles, 4096)."""
    x = F.pad(x, (0, -x.shape[1] % 64, 0, -x.shape[0] % 64))
    return torch.stack(
        [x[i : i + 64, j : j + 64].flatten() for i in range(0, x.shape[0], 64) for j in range(0, x.shape[1], 64)]
    )


def test_error_feedback_accounts_for_every_bit() -> None:
    state = CODEC.new_state()
    e_prev = torch.zeros(200, 150)
    for _ in range(3):
        delta = torch.randn(200, 150)
        sent = CODEC.decode(CODEC.encode("w", delta, state)).to_dense()
        torch.testing.assert_close(sent + state.errors["w"], 0.95 * e_prev + delta)  # e ← β·e + Δ − decoded(sent)
        e_prev = state.errors["w"].clone()


def test_keeps_the_top_k_of_each_64x64_tile() -> None:
    x = torch.randn(200, 150)  # edge tiles: 8 rows, 22 columns, and the 8×22 corner
    sparse = CODEC.decode(CODEC.encode("w", x, CODEC.new_state()))
    mask = torch.zeros(x.numel(), dtype=torch.bool).index_fill_(0, sparse.indices, True).view_as(x)
    kept, mags = tiles(mask.float()), tiles(x.abs())
    for tile_kept, tile_mag in zip(kept, mags):
        assert tile_kept.sum() == 64
        assert tile_mag[tile_kept.bool()].min() >= tile_mag[~tile_kept.bool()].max()
    assert len(sparse.indices.unique()) == len(sparse.indices)


def test_small_tiles_and_1d_tensors_send_everything() -> None:
    x = torch.randn(5, 3)  # one tile with 15 < k elements
    sparse = CODEC.decode(CODEC.encode("w", x, CODEC.new_state()))
    assert sorted(sparse.indices.tolist()) == list(range(15))
    v = torch.randn(130)  # a norm's gains: runs of 64, 64, 2, every value sent (2-bit, the rest in the error buffer)
    state = CODEC.new_state()
    sparse = CODEC.decode(CODEC.encode("v", v, state))
    assert sorted(sparse.indices.tolist()) == list(range(130))
    assert (sparse.values.sign() == v.sign()).all()
    torch.testing.assert_close(sparse.to_dense() + state.errors["v"], v)  # what 2 bits miss waits in the buffer
    for shape in ((), (0, 4), (3, 0), (2, 3, 70), (1, 1)):
        x = torch.randn(shape)
        state = CODEC.new_state()
        sparse = CODEC.decode(CODEC.encode("x", x, state))
        torch.testing.assert_close(sparse.to_dense() + state.errors["x"], x)


def test_two_bit_values_are_symmetric_sign_magnitude() -> None:
    x = torch.randn(64, 64) * 1e-4
    sparse = CODEC.decode(CODEC.encode("w", x, CODEC.new_state()))
    assert sparse.indices.shape == sparse.values.shape == (64,)
    assert len(sparse.values.abs().unique()) <= 2  # one tile, one (a, b) pair
    assert (sparse.values.sign() == x.view(-1)[sparse.indices].sign()).all()
    exact = x.view(-1)[sparse.indices]
    assert (sparse.values - exact).norm() / exact.norm() < 0.15  # 2 bits on the kept tail


def test_a_short_1d_tensor_uses_both_magnitude_levels() -> None:
    # 64 gains are one scale group of 64 values: the zeros that fill it out to 4096 must not drag its mean to ~0
    v = torch.randn(64, generator=torch.Generator().manual_seed(3))
    sparse = CODEC.decode(CODEC.encode("g", v, CODEC.new_state()))
    small, big = sorted(sparse.values.abs().unique().tolist())
    mean = v.abs().mean().item()
    assert small < mean < big and small > 0.2 * mean
    assert (sparse.to_dense() - v).norm() / v.norm() < 0.5  # one level at the mean magnitude: ~0.6


def test_wire_cost_below_a_quarter_bit_per_parameter() -> None:
    x = torch.randn(1024, 768)  # random positions: the worst case for the index coder
    frame = CODEC.encode("w", x, CODEC.new_state())
    assert 8 * len(frame) / x.numel() <= 0.25
    body = decode_frame(frame).body
    m = 64 * x.numel() // 4096
    index_bits = 8 * len(zstandard.compress(body[: 2 * m])) / m  # the two byte planes of the index deltas
    assert index_bits < 9  # vs 12 for fixed packing; ~7.4 is the entropy of 64 positions in 4096


def test_error_feedback_eventually_sends_everything() -> None:
    codec = SparseLoCoCodec(topk=64, error_decay=1.0)
    state, total = codec.new_state(), torch.zeros(64, 64)
    delta = torch.rand(64, 64) + 0.5  # same sign everywhere: a coordinate left out keeps growing
    for _ in range(200):
        total += codec.decode(codec.encode("w", delta, state)).to_dense()
    torch.testing.assert_close(total + state.errors["w"], 200 * delta, rtol=1e-4, atol=1e-3)
    assert (total > 0).all()  # every coordinate was sent at some point


def test_aggregate_mean_over_senders_only() -> None:
    a = SparseTensor(torch.tensor([0, 2]), torch.tensor([1.0, 4.0]), (2, 2))
    b = SparseTensor(torch.tensor([2, 3]), torch.tensor([2.0, -6.0]), (2, 2))
    assert torch.equal(aggregate_mean([a, b]), torch.tensor([[1.0, 0.0], [3.0, -6.0]]))
    with pytest.raises(ValueError, match="same shape"):
        aggregate_mean([a, SparseTensor(torch.tensor([0]), torch.tensor([1.0]), (4,))])
    with pytest.raises(ValueError):
        aggregate_mean([])


def test_replicas_aggregate_through_the_wire() -> None:
    deltas = [torch.randn(128, 96) for _ in range(3)]
    parts = [CODEC.decode(CODEC.encode("w", d, CODEC.new_state())) for d in deltas]
    mean = aggregate_mean(parts)
    count = sum(p.to_dense() != 0 for p in parts)
    torch.testing.assert_close(mean * count.clamp(min=1), sum(p.to_dense() for p in parts))


def test_encode_refuses_bad_input() -> None:
    state = CODEC.new_state()
    CODEC.encode("w", torch.randn(4, 4), state)
    with pytest.raises(ValueError, match="error buffer"):
        CODEC.encode("w", torch.randn(4, 5), state)
    with pytest.raises(ValueError, match="NaN"):
        CODEC.encode("v", torch.tensor([1.0, float("inf")]), state)
    for kwargs in ({"topk": 0}, {"chunk_size": 4000}, {"error_decay": 1.5}):
        with pytest.raises(ValueError):
            SparseLoCoCodec(**kwargs)


def _body(frame: bytes) -> bytes:
    return decode_frame(frame).body


def test_hostile_frames_raise_wire_errors() -> None:
    x = torch.randn(64, 64)
    frame = CODEC.encode("w", x, CODEC.new_state())
    body, meta = bytearray(_body(frame)), decode_frame(frame).meta
    reframe = lambda b, shape=(64, 64), m=meta: encode_frame(
        CodecId.SPARSELOCO, bytes(b), dtype=torch.float32, shape=shape, meta=m
    )
    repeated = bytearray(body)
    repeated[1] = 0  # second index delta 0: a duplicate index
    with pytest.raises(MalformedFrame, match="strictly increasing"):
        CODEC.decode(reframe(repeated))
    beyond = bytearray(body)
    beyond[64 + 63] = 0xFF  # high byte of the last delta: index past the chunk
    with pytest.raises(MalformedFrame):
        CODEC.decode(reframe(beyond))
    with pytest.raises(ShapeMismatch, match="needs"):
        CODEC.decode(reframe(body, shape=(64, 65)))
    with pytest.raises(ShapeMismatch, match="topk"):
        SparseLoCoCodec(topk=32).decode(frame)
    nan_scales = bytearray(body)
    nan_scales[-2:] = b"\xc0\x7f"  # bf16 NaN
    with pytest.raises(NonFiniteValues):
        CODEC.decode(reframe(nan_scales))
    with pytest.raises(UnknownCodec):
        CODEC.decode(encode_frame(CodecId.INT8, b"", dtype=torch.float32, shape=(0,)))
    # a sender may point into an edge tile's padding (it does when a tile has < k elements): dropped
    padded = (
        bytes([0] + [1] * 63)
        + bytes(64)
        + bytes(16)
        + torch.tensor([1.0, 2.0]).bfloat16().view(torch.uint8).numpy().tobytes()
    )
    sparse = CODEC.decode(encode_frame(CodecId.SPARSELOCO, padded, dtype=torch.float32, shape=(3, 3), meta=meta))
    assert sparse.indices.tolist() == [0, 1, 2] and sparse.values.tolist() == [1.0, 1.0, 1.0]


VALID = [
    (CODEC.encode("a", torch.randn(70, 130), CODEC.new_state()), (70, 130)),
    (CODEC.encode("b", torch.randn(300), CODEC.new_state()), (300,)),
]
LIMITS = WireLimits(max_elements=1 << 16, max_body_bytes=1 << 20)


def _decode_checked(data: bytes) -> None:
    try:
        sparse = CODEC.decode(data, limits=LIMITS)
    except WireError:
        return
    n = torch.Size(sparse.shape).numel()
    assert len(sparse.indices) == len(sparse.values) and (
        n == 0 or (0 <= int(sparse.indices.min()) and int(sparse.indices.max()) < n)
    )


@settings(deadline=None, max_examples=300)
@given(
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
    st.booleans(),
)
def test_fuzz_corrupt_bodies_behind_valid_checksums(
    valid: tuple[bytes, tuple[int, ...]], edits: list[tuple[int, int]], raw: bool
) -> None:
    frame, shape = valid
    if raw:  # the transmitted bytes (mostly caught by the crc)
        buf = bytearray(frame)
        for pos, value in edits:
            buf[pos % len(buf)] = value
        _decode_checked(bytes(buf))
        return
    body = bytearray(_body(frame))
    for pos, value in edits:
        body[pos % len(body)] = value
    _decode_checked(
        encode_frame(CodecId.SPARSELOCO, bytes(body), dtype=torch.float32, shape=shape, meta=decode_frame(frame).meta)
    )


@settings(deadline=None, max_examples=200)
@given(st.lists(st.integers(0, 3000), max_size=3), st.binary(max_size=300), st.binary(max_size=6))
def test_fuzz_arbitrary_frames(shape: list[int], body: bytes, meta: bytes) -> None:
    _decode_checked(encode_frame(CodecId.SPARSELOCO, body, dtype=torch.float32, shape=tuple(shape), meta=meta))
    _decode_checked(
        encode_frame(
            CodecId.SPARSELOCO, body, dtype=torch.float32, shape=tuple(shape), meta=decode_frame(VALID[0][0]).meta
        )
    )


def test_a_frame_of_another_shape_is_refused_from_its_header() -> None:
    frame, shape = VALID[0]
    assert CODEC.decode(frame, expected_shape=shape).shape == shape
    assert CODEC.limits_for(shape).max_body_bytes == len(decode_frame(frame).body)  # the shape fixes the body's size
    with pytest.raises(ShapeMismatch, match=r"declares shape \(70, 130\), the receiver expects \(1, 67108864\)"):
        CODEC.decode(frame, expected_shape=(1, 64 << 20))
    huge = CODEC.limits_for((1, 64 << 20)).max_body_bytes  # what a (1, 64M) frame would make a receiver hold
    assert huge > 128 << 20
