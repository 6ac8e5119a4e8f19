"""The outer step where the weights lie: Δ, top-k, error feedback and decoding never move a weight-sized tensor to the
host, and SparseLoCo's device path (run here on the CPU) steps a group exactly as its host path does."""

import pytest
import torch

import compress.sparseloco as sparseloco
from compress.codecs import get_codec
from compress.sparseloco import SparseLoCoCodec
from optim.noloco import NoLoCo
from optim.outer import DiLoCo, OuterOptimizer, SparseLoCo

SHAPES = {"embed": (256, 768), "w1": (768, 2048), "norm": (768,)}  # a 125m stage's kinds of parameter


def stage(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def make(kind: str, params: dict[str, torch.Tensor]) -> OuterOptimizer:
    if kind == "diloco":
        return DiLoCo(params, codec=get_codec("int8"))
    if kind == "noloco":
        return NoLoCo(params, codec=get_codec("bf16"))
    return SparseLoCo(params, codec=SparseLoCoCodec(topk=64))


def group_round(kind: str, replicas: int = 2) -> list[dict[str, torch.Tensor]]:
    """One outer round of ``replicas`` members that trained apart from the same start; their weights after it."""
    start = stage(0)
    opts = [make(kind, start) for _ in range(replicas)]
    local = [{n: p + 0.01 * q for (n, p), q in zip(start.items(), stage(1 + i).values())} for i in range(replicas)]
    payloads = [opt.make_payload(theta) for opt, theta in zip(opts, local)]
    for opt, theta in zip(opts, local):
        opt.apply(payloads, theta)
    return local


@pytest.mark.parametrize("kind", ["diloco", "noloco", "sparseloco"])
def test_no_weight_sized_tensor_is_moved_to_the_host(monkeypatch, kind: str) -> None:
    def refuse(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError(f"a {self.dtype} tensor of shape {tuple(self.shape)} was moved with .cpu()")

    monkeypatch.setattr(torch.Tensor, "cpu", refuse)
    group_round(kind)


def test_sparselocos_device_path_steps_the_group_as_its_host_path(monkeypatch) -> None:
    on_host = group_round("sparseloco")
    monkeypatch.setattr(sparseloco, "codes_on_host", lambda device: False)
    on_device = group_round("sparseloco")
    for a, b in zip(on_host, on_device):
        assert all(torch.equal(a[name], b[name]) for name in SHAPES)
