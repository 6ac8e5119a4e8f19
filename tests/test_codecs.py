"""Activation / activation-gradient codecs and the registry; fuzzed frames raise only WireError."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compress.adaptive import Ladder
from compress.codec_base import BOUNDARY_MAX_ABS, Codec, all_finite
from compress.codecs import CODEC_NAMES, get_codec
from compress.errors import LimitExceeded, MalformedFrame, NonFiniteValues, ShapeMismatch, UnknownCodec, WireError
from compress.sparseloco import SparseLoCoCodec
from compress.wire import CodecId, WireLimits, decode_frame, encode_frame
from swarm.model.transformer import ModelConfig, Transformer, loss_fn, subspace_basis
from swarmtest.attacks import huge_scale

torch.manual_seed(0)
SMALL = ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=16, subspace_rank=8)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def boundary(cfg: ModelConfig) -> tuple[Transformer, torch.Tensor, torch.Tensor]:
    """A model, token ids (2, T) and the hidden state after its first block (2, T, d)."""
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len))
    with torch.no_grad():
        return model, tokens, model.run_blocks(model.embed(tokens), range(1))


@pytest.mark.parametrize(
    ("name", "max_error"), [("fp32", 0.0), ("fp16", 1e-3), ("bf16", 5e-3), ("int8", 1e-2), ("int4", 0.15)]
)
def test_dense_codecs_round_trip(name: str, max_error: float) -> None:
    x = torch.randn(3, 17, 33) * torch.logspace(-4, 0, 17)[None, :, None]  # token scales over 4 decades
    codec = get_codec(name)
    y = codec.decode(codec.encode(x))
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert rel_error(y, x) <= max_error
    if name.startswith("int"):  # per-token scales: small tokens keep their relative precision …
        per_token = ((y - x).norm(dim=-1) / x.norm(dim=-1)).max()
        assert per_token <= 2 * max_error
        x[0, 0] = 1e-9  # … down to 2**-16 of the largest token's absmax; below, the error is at most that
        assert (codec.decode(codec.encode(x))[0, 0] - x[0, 0]).abs().max() <= 2**-16 * x.abs().max()


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "int8", "int4"])
@pytest.mark.parametrize("shape", [(0, 5), (4, 0), (1,), (2, 3, 1), (5, 7)])
def test_edge_shapes(name: str, shape: tuple[int, ...]) -> None:
    codec = get_codec(name)
    x = torch.randn(shape)
    bound = 0.1 * x.abs().max() if x.numel() else 0.0  # int4's step is absmax / 7
    assert ((codec.decode(codec.encode(x)) - x).abs() <= bound).all()
    assert codec.decode(codec.encode(torch.zeros(shape))).abs().sum() == 0


def test_int8_scales_cost_one_byte_per_token() -> None:
    codec = get_codec("int8")
    assert codec.estimated_ratio((16, 128, 128)) >= 3.9
    assert get_codec("int4").estimated_ratio((16, 128, 128)) >= 7.5
    x = torch.randn(16, 128, 128)
    assert 4 * x.numel() / len(codec.encode(x)) >= codec.estimated_ratio(x.shape) * 0.99  # zstd never makes it worse


def test_nonfinite_values() -> None:
    x = torch.randn(4, 8)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        get_codec("int8").encode(x)
    with pytest.raises(ValueError, match="fp16"):
        get_codec("fp16").encode(torch.full((2, 2), 1e6))
    frame = get_codec("fp32").encode(x)
    with pytest.raises(NonFiniteValues):
        get_codec("fp32").decode(frame)
    assert get_codec("fp32").decode(frame, allow_nonfinite=True).isnan().sum() == 1


def test_subspace_is_exact_on_the_constrained_model() -> None:
    basis, table = subspace_basis(SMALL)
    _, tokens, h = boundary(SMALL)
    for name in ("subspace", "subspace+int8"):
        codec = get_codec(name, basis=basis, table=table)
        y, got_tokens = codec.decode_with_tokens(codec.encode(h, tokens=tokens))
        assert torch.equal(got_tokens, tokens)
        assert rel_error(y, h) < (1e-5 if name == "subspace" else 1e-2)


def test_subspace_ratios_at_d_over_k_8() -> None:
    cfg = ModelConfig(subspace_rank=16)  # d=128, k=16
    basis, table = subspace_basis(cfg)
    model = Transformer(cfg)
    tokens = torch.randint(0, 256, (16, 128))
    with torch.no_grad():
        h = model.embed(tokens)
    for name, target in (("subspace", 7.5), ("subspace+int8", 28.0)):
        codec = get_codec(name, basis=basis, table=table)
        assert codec.estimated_ratio(h.shape) >= target
        assert 4 * h.numel() / len(codec.encode(h, tokens=tokens)) >= target


def test_subspace_refuses_the_unconstrained_model() -> None:
    basis, table = subspace_basis(SMALL)
    _, tokens, h = boundary(ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=16))
    with pytest.raises(ValueError, match="not in the subspace"):
        get_codec("subspace", basis=basis, table=table).encode(h, tokens=tokens)


def test_subspace_mismatched_setups() -> None:
    basis, table = subspace_basis(SMALL)
    _, tokens, h = boundary(SMALL)
    frame = get_codec("subspace", basis=basis, table=table).encode(h, tokens=tokens)
    wrong_k = subspace_basis(ModelConfig(d_model=64, n_heads=4, subspace_rank=16))
    with pytest.raises(ValueError, match="not in the subspace"):  # sender built with the wrong k
        get_codec("subspace", basis=wrong_k[0], table=wrong_k[1]).encode(h, tokens=tokens)
    with pytest.raises(ShapeMismatch, match="k=8"):  # receiver with the wrong k
        get_codec("subspace", basis=wrong_k[0], table=wrong_k[1]).decode(frame)
    other_seed = subspace_basis(ModelConfig(d_model=64, n_heads=4, subspace_rank=8, subspace_seed=7))
    with pytest.raises(ShapeMismatch, match="different subspace basis"):
        get_codec("subspace", basis=other_seed[0], table=other_seed[1]).decode(frame)
    with pytest.raises(ValueError, match="basis"):
        get_codec("subspace+int8")
    with pytest.raises(ValueError, match="token table"):
        get_codec("subspace", basis=basis)
    with pytest.raises(ValueError, match="token ids"):
        get_codec("subspace", basis=basis, table=table).encode(h)


def test_subspace_gradient_gives_exact_parameter_gradients() -> None:
    model, tokens, _ = boundary(SMALL)
    targets = torch.randint(0, 256, tokens.shape)
    h = model.run_blocks(model.embed(tokens), range(1))  # upstream stage, with its graph
    h_in = h.detach().requires_grad_()
    loss_fn(model.lm_head(model.norm(model.run_blocks(h_in, range(1, 2)))), targets).backward()
    g = h_in.grad
    upstream = [p for n, p in model.named_parameters() if n.startswith(("embed", "blocks.0"))]
    exact = torch.autograd.grad(h, upstream, g, retain_graph=True)
    codec = get_codec("subspace", basis=subspace_basis(SMALL)[0], kind="gradient")
    g_hat = codec.decode(codec.encode(g))
    assert rel_error(g_hat, g) > 0.5  # the boundary gradient itself is far from span(U) …
    for a, b in zip(torch.autograd.grad(h, upstream, g_hat), exact):
        assert rel_error(a, b) < 1e-5  # … yet every upstream parameter gradient is exact (to fp32 rounding)
    assert codec.estimated_ratio(g.shape) > 7.5


def test_registry_round_trips_every_codec_and_refuses_foreign_frames() -> None:
    basis, table = subspace_basis(SMALL)
    _, tokens, h = boundary(SMALL)
    for name in CODEC_NAMES:
        codec = get_codec(name, basis=basis, table=table)
        frame = codec.encode(h, tokens=tokens)
        assert decode_frame(frame).codec_id == codec.codec_id
        assert codec.decode(frame).shape == h.shape
    int8 = get_codec("int8")
    with pytest.raises(UnknownCodec, match="expected 'int8'"):
        int8.decode(get_codec("fp16").encode(h))
    with pytest.raises(UnknownCodec):  # a subspace frame to a receiver that expects int8
        int8.decode(get_codec("subspace", basis=basis, table=table).encode(h, tokens=tokens))
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("int3")


def _all_codecs() -> list[Codec]:
    basis, table = subspace_basis(SMALL)
    return [get_codec(n, basis=basis, table=table, kind=k) for n in CODEC_NAMES for k in ("activation", "gradient")]


ALL = _all_codecs()
_, TOKENS, H = boundary(SMALL)
PACKED = [(c, *c.pack(H[:, :3], TOKENS[:, :3])) for c in ALL]  # (codec, meta, body) of valid frames
LIMITS = WireLimits(max_elements=1 << 16, max_body_bytes=1 << 20)


def _decode_checked(data: bytes, shape: tuple[int, ...] | None) -> None:
    """Decode as every receiver would (each knows its codec): only WireError may escape."""
    for codec in ALL:
        try:
            y = codec.decode(data, limits=LIMITS)
        except WireError:
            continue
        assert shape is None or y.shape == shape


@settings(deadline=None, max_examples=300)
@given(
    st.sampled_from(PACKED),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
    st.booleans(),
    st.booleans(),
)
def test_fuzz_checksummed_frames_with_corrupt_contents(
    packed: tuple[Codec, bytes, bytes], edits: list[tuple[int, int]], in_meta: bool, reshape: bool
) -> None:
    """Frames that pass the crc but hold mutated metadata, bodies or shapes: only WireError escapes."""
    codec, meta, body = packed
    meta, body = bytearray(meta), bytearray(body)
    for pos, value in edits:
        target = meta if in_meta and meta else body
        if target:
            target[pos % len(target)] = value
    shape = (2, 3, 64) if not reshape else (3, 2, 64)
    _decode_checked(
        encode_frame(codec.codec_id, bytes(body), dtype=torch.float32, shape=shape, meta=bytes(meta)), shape
    )


@settings(deadline=None, max_examples=300)
@given(
    st.sampled_from(list(CodecId)),
    st.lists(st.integers(0, 70), max_size=4),
    st.binary(max_size=64),
    st.binary(max_size=600),
)
def test_fuzz_arbitrary_checksummed_frames(codec_id: CodecId, shape: list[int], meta: bytes, body: bytes) -> None:
    _decode_checked(encode_frame(codec_id, body, dtype=torch.float32, shape=tuple(shape), meta=meta), tuple(shape))


def test_decoding_is_bounded_by_declared_shape() -> None:
    frame = encode_frame(CodecId.FP32, b"\0" * 16, dtype=torch.float32, shape=(1 << 30,))
    with pytest.raises(WireError):  # over max_elements: refused before any allocation
        get_codec("fp32").decode(frame)
    frame = encode_frame(CodecId.INT8, b"\0" * 16, dtype=torch.float32, shape=(1 << 20, 0), meta=b"\0\0\x80?")
    with pytest.raises(ShapeMismatch):  # 0 elements but 2**20 token scales declared
        get_codec("int8").decode(frame)


def test_a_receiver_that_knows_the_shape_allocates_nothing_for_another() -> None:
    for codec in ALL:
        frame = codec.encode(H, tokens=TOKENS)
        assert codec.decode(frame, expected_shape=tuple(H.shape)).shape == H.shape  # the shape's own limits fit it
        with pytest.raises(ShapeMismatch, match="the receiver expects"):
            codec.decode(frame, expected_shape=(H.shape[0], H.shape[1] + 1, H.shape[2]))
    # the right shape, but a body (an 8 KiB zstd frame of zeros) far larger than that shape needs in fp32
    fp32 = get_codec("fp32")
    bomb = encode_frame(CodecId.FP32, bytes(4 << 20), dtype=torch.float32, shape=(64, 64))
    assert len(bomb) < 8 << 10
    with pytest.raises(LimitExceeded, match="body of"):
        fp32.decode(bomb, expected_shape=(64, 64))
    assert fp32.limits_for((64, 64)).max_body_bytes == 4 * 64 * 64


def test_default_limits_keep_a_small_frame_from_becoming_a_huge_body() -> None:
    bomb = encode_frame(CodecId.FP32, bytes(256 << 20), dtype=torch.float32, shape=(64 << 20,))  # ~8 KiB on the wire
    assert len(bomb) < 16 << 10
    with pytest.raises(LimitExceeded):
        get_codec("fp32").decode(bomb)


# ---- frame scales: bounded by what an encoder makes of finite values -------------------------------------------

F32_MAX, BF16_MAX = torch.finfo(torch.float32).max, torch.finfo(torch.bfloat16).max


def with_scale(frame: bytes, top: float, dtype: torch.dtype | None = None) -> bytes:
    """The int8/int4 frame with its scale (``top``) and, if given, its declared dtype replaced."""
    parsed = decode_frame(frame)
    return encode_frame(
        parsed.codec_id, parsed.body, dtype=dtype or parsed.dtype, shape=parsed.shape, meta=struct.pack("<f", top)
    )


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_scale_no_encoder_makes_from_finite_values_is_refused(name: str) -> None:
    codec = get_codec(name)
    frame = codec.encode(torch.randn(2, 5, 16))
    beyond = (F32_MAX,) if name == "int8" else ()  # int8's full scale, 127 · (F32_MAX / 127), rounds to inf in fp32
    for top in (math.inf, math.nan, 0.0, -1.0, *beyond):
        with pytest.raises(MalformedFrame, match="scale"):
            codec.decode(with_scale(frame, top))
    with pytest.raises(MalformedFrame, match=r"what a finite torch.bfloat16 tensor can be coded with"):
        codec.decode(with_scale(frame, 3.4e38, torch.bfloat16))  # over bf16's largest, 3.3895e38
    with pytest.raises(MalformedFrame, match="scale"):
        codec.decode(with_scale(frame, 65536.0, torch.float16))
    # an fp32 tensor can hold 3.4e38, so the codec takes it; a receiver of boundary tensors (the stage server) does not
    attack = huge_scale(get_codec("int8").encode(torch.randn(2, 5, 16)))
    assert get_codec("int8").decode(attack).abs().max() > 1e38
    with pytest.raises(LimitExceeded, match="over the receiver's limit of 1.84e\\+19"):
        get_codec("int8").decode(attack, limits=WireLimits(max_abs=BOUNDARY_MAX_ABS))
    with pytest.raises(LimitExceeded):  # the stage server's ladder of codecs applies it too
        Ladder([get_codec("bf16"), get_codec("int8")]).decode(attack, limits=WireLimits(max_abs=BOUNDARY_MAX_ABS))


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4", "subspace+int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_frame_encoded_from_finite_values_decodes_even_at_the_extremes(name: str, dtype: torch.dtype) -> None:
    """At the real shape (8 × 1024 × 768): the largest finite values of the dtype, and 3.38e38, decode finite."""
    basis = torch.linalg.qr(torch.randn(768, 96)).Q
    codec = get_codec(name, basis=basis, kind="gradient")
    x = torch.randn(8, 1024, 768).to(dtype)
    extremes = (F32_MAX if dtype == torch.float32 else BF16_MAX, 3.38e38, 1e-38)
    if name.startswith("subspace"):
        extremes = (1e37, 1e-38)  # z = x U: an fp32 value of 3.4e38 projects beyond fp32; 1e37 does not
    for i, value in enumerate(extremes):
        x[i, 0, :4] = torch.tensor([value, -value, value, -value], dtype=dtype)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and all_finite(y)
    if not name.startswith("subspace"):  # the extremes come back within the codec's own precision (bf16: 0.4%)
        assert torch.allclose(y[:2, 0, :4], x[:2, 0, :4].float(), rtol=1e-2, atol=0.0)


def test_a_sparseloco_frame_of_finite_extremes_decodes_finite() -> None:
    """SparseLoCo's value scales are bf16 means of the sent magnitudes: from finite fp32 values they are finite (the
    means are summed in fp64; in fp32 two values near 3.4e38 summed to inf), so finiteness is their bound."""
    codec = SparseLoCoCodec(topk=64)
    for value in (3.38e38, F32_MAX):
        delta = torch.randn(128, 256)
        delta[:8, :70] = value
        delta[8:16, :70] = -value
        sent = codec.decode(codec.encode("w", delta, codec.new_state()))
        assert all_finite(sent.values) and sent.values.abs().max() >= 3.37e38
