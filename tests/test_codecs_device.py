"""Codecs on the tensor's device: the same frames as the host path made, only coded bytes cross, zstd where it pays."""

import hashlib
import os

import pytest
import torch

import compress.transfer as transfer
from compress.codecs import CODEC_NAMES, get_codec
from compress.transfer import HostCopy, host_copy, to_device, to_host
from compress.wire import CodecId, decode_frame, encode_frame, raw_frame_bytes, zstd_pays
from swarm.model.transformer import ModelConfig, subspace_basis

SHAPE = (8, 1024, 768)  # a 125m microbatch of 8 x 1024 tokens
# sha256[:16] of (meta + body) of each codec's frame, and of its decoded tensor, as the host path (before the codecs
# ran on the device) made them from ``real_size_tensor()``: any change here is a change of the wire format
GOLDEN = {
    ("fp32", torch.float32): ("254c966d3f9539ee", "254c966d3f9539ee"),
    ("fp32", torch.bfloat16): ("dbcaac790b69958d", "dbcaac790b69958d"),
    ("fp16", torch.float32): ("e6d896ebc697cbb4", "d9e17e39d798ce76"),
    ("fp16", torch.bfloat16): ("e2522453d21783a7", "dbcaac790b69958d"),
    ("bf16", torch.float32): ("1e0eaccbecfda95d", "dbcaac790b69958d"),
    ("bf16", torch.bfloat16): ("1e0eaccbecfda95d", "dbcaac790b69958d"),
    ("int8", torch.float32): ("76a5f76fef65ab71", "60f91bfe93426df7"),
    ("int8", torch.bfloat16): ("4771c98993e4ba9c", "29ad9f8757a5d597"),
    ("int4", torch.float32): ("2127910cf60480f2", "352f8fd3f4340c69"),
    ("int4", torch.bfloat16): ("23d13a056ba484ee", "9af091a5d3633a90"),
}


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


@pytest.fixture(scope="module")
def real_size_tensor() -> torch.Tensor:
    """Activation-like values with per-token scales, from integers (the same on every machine)."""
    g = torch.Generator().manual_seed(34)
    scale = torch.randint(1, 64, (*SHAPE[:-1], 1), generator=g).float() / 16
    return torch.randint(-(2**20), 2**20, SHAPE, generator=g).float() / 2**18 * scale


@pytest.mark.parametrize(("name", "dtype"), list(GOLDEN))
def test_frames_and_decodes_are_those_of_the_host_path(real_size_tensor, name: str, dtype: torch.dtype) -> None:
    codec = get_codec(name)
    frame = codec.encode(real_size_tensor.to(dtype))
    parsed = decode_frame(frame)
    decoded = codec.decode(frame, device=torch.device("cpu"))
    assert (digest(parsed.meta + bytes(parsed.body)), digest(decoded.numpy().tobytes())) == GOLDEN[(name, dtype)]
    assert torch.equal(decoded, codec.decode(frame))


def test_only_coded_bytes_cross_to_the_host_and_no_tensor_is_moved_whole(monkeypatch, real_size_tensor) -> None:
    """Every codec codes where the tensor lies: nothing calls ``.cpu()``, and what reaches the host is uint8 codes."""
    crossed: list[torch.dtype] = []
    gather = transfer._gather
    monkeypatch.setattr(transfer, "_gather", lambda ts, copy: crossed.extend(t.dtype for t in ts) or gather(ts, copy))

    def refuse(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError(f"a {self.dtype} tensor of shape {tuple(self.shape)} was moved with .cpu()")

    monkeypatch.setattr(torch.Tensor, "cpu", refuse)
    cfg = ModelConfig(d_model=64, n_heads=2, n_layers=2, subspace_rank=8)
    basis, table = subspace_basis(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    z = torch.randn(2, 16, 8)
    activations = z @ basis.T + table[tokens]
    for name in CODEC_NAMES:
        for kind, x in (("activation", activations), ("gradient", torch.randn(2, 16, 64))):
            codec = get_codec(name, basis=basis, table=table, kind=kind)
            crossed.clear()
            frame = codec.encode(x, tokens=tokens)
            assert crossed and all(d in (torch.uint8,) for d in crossed), (name, crossed)
            assert codec.decode(frame, device=torch.device("cpu")).shape == x.shape


def test_the_copy_is_chosen_by_the_device() -> None:
    assert host_copy(torch.device("cpu")) == HostCopy(staged=False, pinned=False, non_blocking=False)
    assert host_copy(torch.device("cuda", 0)) == HostCopy(staged=True, pinned=True, non_blocking=True)
    assert host_copy(torch.device("meta")) == HostCopy(staged=True, pinned=False, non_blocking=False)
    with pytest.raises(ValueError, match="staging"):
        HostCopy(staged=False, pinned=True, non_blocking=False)


def test_a_staged_copy_gives_the_same_bytes_as_reading_in_place() -> None:
    """The CUDA path's staging buffer and single copy, run on the CPU (pinned memory needs CUDA; the rest is alike)."""
    staged = HostCopy(staged=True, pinned=False, non_blocking=False)
    parts = [[b"head", torch.arange(5, dtype=torch.float32)], [torch.arange(7, dtype=torch.uint8)[1::2], b"!"], []]
    assert (
        to_host(parts, staged)
        == to_host(parts)
        == [
            b"head" + torch.arange(5, dtype=torch.float32).numpy().tobytes(),
            bytes([1, 3, 5]) + b"!",
            b"",
        ]
    )
    body = bytes(range(256)) * 3
    assert torch.equal(to_device(body, torch.device("cpu"), staged), to_device(body, torch.device("cpu")))
    assert to_device(b"", torch.device("cpu"), staged).numel() == 0


def test_an_int8_frame_decodes_alike_on_a_subspace_offset() -> None:
    """A subspace frame's inner body starts after the token ids (odd for uint8 ids): views of it stay aligned."""
    cfg = ModelConfig(d_model=64, n_heads=2, n_layers=2, subspace_rank=8)
    basis, table = subspace_basis(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 7))
    x = torch.randn(1, 7, 8) @ basis.T + table[tokens]
    for name in ("subspace", "subspace+fp16", "subspace+bf16"):
        codec = get_codec(name, basis=basis, table=table)
        y, got = codec.decode_with_tokens(codec.encode(x, tokens=tokens), device=torch.device("cpu"))
        assert torch.allclose(y, x, atol=1e-2) and torch.equal(got, tokens)


def test_zstd_is_kept_only_where_it_saves_a_tenth() -> None:
    noise = os.urandom(90_000)
    barely, clearly = noise + bytes(10_000 - 4_000), noise + bytes(40_000)  # zstd saves ~6% and ~30%
    for body, packed in ((barely, False), (clearly, True)):
        frame = encode_frame(CodecId.INT8, body, dtype=torch.float32, shape=(len(body),))
        assert (raw_frame_bytes(frame) != len(frame)) is packed
        assert bytes(decode_frame(frame).body) == body
    unpacked = encode_frame(CodecId.INT8, clearly, dtype=torch.float32, shape=(len(clearly),), compress=False)
    assert raw_frame_bytes(unpacked) == len(unpacked) and bytes(decode_frame(unpacked).body) == clearly
    assert zstd_pays(100, 90) and not zstd_pays(100, 91)


def test_a_round_trip_on_the_device_decodes_as_the_frame_and_counts_its_raw_bytes(monkeypatch) -> None:
    """``round_trip`` (the simulator's link without zstd): what a receiver decodes, and only a few bytes cross."""
    crossed: list[int] = []
    gather = transfer._gather
    monkeypatch.setattr(transfer, "_gather", lambda ts, copy: crossed.extend(t.numel() for t in ts) or gather(ts, copy))
    cfg = ModelConfig(d_model=64, n_heads=2, n_layers=2, subspace_rank=8)
    basis, table = subspace_basis(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 32))
    activations = torch.randn(4, 32, 8) @ basis.T + table[tokens]
    for name in CODEC_NAMES:
        for kind, x in (("activation", activations), ("gradient", torch.randn(4, 32, 64))):
            codec = get_codec(name, basis=basis, table=table, kind=kind)
            frame = codec.encode(x, tokens=tokens)
            crossed.clear()
            y, nbytes = codec.round_trip(x, tokens)
            assert torch.equal(y, codec.decode(frame)) and nbytes == raw_frame_bytes(frame), name
            assert sum(crossed) <= 64, (name, crossed)  # the meta and the checks, never the body
