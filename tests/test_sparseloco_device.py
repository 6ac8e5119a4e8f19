"""SparseLoCo coded where the pseudo-gradient lies: the device path (torch) makes the host path's (numpy) frames."""

import pytest
import torch

import compress.sparseloco as sparseloco
from compress.sparseloco import SparseLoCoCodec, codes_on_host

SHAPES = [(256, 768), (100, 70), (3, 5), (2, 3, 40), (300,), (5,), (4096 + 7,), (0, 4)]


def rounds(on_host: bool, monkeypatch, shape: tuple[int, ...], topk: int, tile: int) -> list[object]:
    """Frames and error buffers of three rounds of one tensor, coded by the host or the device path."""
    monkeypatch.setattr(sparseloco, "codes_on_host", lambda device: on_host)
    codec, g = SparseLoCoCodec(topk=topk, chunk_size=tile * tile), torch.Generator().manual_seed(7)
    state, out = codec.new_state(), []
    for _ in range(3):
        frame = codec.encode("w", torch.randn(shape, generator=g), state)
        out += [frame, state.errors["w"].clone()]
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("topk", "tile"), [(64, 64), (5, 8)])
def test_the_device_path_makes_the_host_paths_frames_and_errors(monkeypatch, shape, topk: int, tile: int) -> None:
    host, device = rounds(True, monkeypatch, shape, topk, tile), rounds(False, monkeypatch, shape, topk, tile)
    for a, b in zip(host, device):
        assert (a == b) if isinstance(a, bytes) else torch.equal(a, b)


def test_a_real_size_stage_parameter(monkeypatch) -> None:
    """A 125m MLP weight (768 x 2048): the device path gives the host path's frame and error buffer."""
    host, device = (rounds(flag, monkeypatch, (2048, 768), 64, 64)[:2] for flag in (True, False))
    assert host[0] == device[0] and torch.equal(host[1], device[1])


def test_ties_at_the_kth_magnitude_keep_the_first_columns_on_both_paths(monkeypatch) -> None:
    """Weights that moved by the same few ulps give equal magnitudes: both paths keep the same ones."""
    g = torch.Generator().manual_seed(3)
    delta = torch.randint(-3, 4, (130, 70), generator=g).float() * 2**-20
    frames = []
    for on_host in (True, False):
        monkeypatch.setattr(sparseloco, "codes_on_host", lambda device, on_host=on_host: on_host)
        codec = SparseLoCoCodec(topk=64)
        state = codec.new_state()
        frames.append((codec.encode("w", delta, state), state.errors["w"]))
    assert frames[0][0] == frames[1][0] and torch.equal(frames[0][1], frames[1][1])
    kept = SparseLoCoCodec(topk=64).decode(frames[0][0]).indices.view(-1)
    first_tile = kept[(kept // 70 < 64) & (kept % 70 < 64)]
    top = delta[:64, :64].abs().reshape(-1)
    local = (first_tile // 70 * 64 + first_tile % 70).sort().values
    assert torch.equal(local, torch.nonzero(top == top.max()).view(-1)[:64])


def test_non_finite_values_are_refused_and_leave_the_error_buffer(monkeypatch) -> None:
    monkeypatch.setattr(sparseloco, "codes_on_host", lambda device: False)
    codec = SparseLoCoCodec(topk=8, chunk_size=64)
    state = codec.new_state()
    codec.encode("w", torch.ones(16, 16), state)
    kept = state.errors["w"]
    bad = torch.ones(16, 16)
    bad[3, 4] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        codec.encode("w", bad, state)
    assert state.errors["w"] is kept


def test_the_cpu_codes_with_numpy_and_any_other_device_with_torch() -> None:
    assert codes_on_host(torch.device("cpu"))
    assert not codes_on_host(torch.device("cuda", 0)) and not codes_on_host(torch.device("mps"))
