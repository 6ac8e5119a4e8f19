"""The faster step (issue 34): torch.compile of a stage's blocks (same numbers and names as eager, eager again when
compiling fails, off on a CPU by default), fused optimizers chosen on CUDA only, pinned batch copies on CUDA only,
and train-local's microbatch loop reading its losses from the device once per logging window."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from compress.transfer import host_copy
from optim.config import InnerOptimConfig
from optim.inner import fused_kwargs, make_inner_optimizer
from swarm.config import SwarmConfig, derive_config
from swarm.errors import ConfigError
from swarm.model.compiling import compile_stage, resolve_compile
from swarm.model.stages import EdgeStage, MiddleStage, build_stage
from swarm.model.step import microbatch_loss, stage_gradients, trainable
from swarm.model.transformer import ModelConfig
from swarm.node.config import PeerConfig
from swarm.pipeline.server import StageServer, warm_up
from swarm.sim.centralized import to_device, train_centralized
from swarmtest.configs import rpc_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a cuda device object needs no GPU
TINY = ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=64)


def middle(cfg: ModelConfig = TINY) -> MiddleStage:
    stage = build_stage(cfg, 1, 1)
    assert isinstance(stage, MiddleStage)
    return stage


def test_auto_compiles_on_cuda_only() -> None:
    assert resolve_compile("auto", CUDA) and not resolve_compile("auto", CPU)
    assert resolve_compile("on", CPU) and not resolve_compile("off", CUDA)
    stage = middle()
    report = compile_stage(stage, "auto", CPU)
    assert not report.enabled and report.fields() == {} and "eager" in report.describe()
    assert all(block._compiled_call_impl is None for block in stage.blocks)
    with pytest.raises(ValueError, match="compile"):
        resolve_compile("yes", CPU)  # type: ignore[arg-type]  # a bad mode, as a caller without types would pass
    assert PeerConfig.from_flat({"compile": "on"}).compile == "on" and PeerConfig().compile == "auto"
    with pytest.raises(ConfigError, match="compile"):
        PeerConfig.from_flat({"compile": "always"})


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_compiled_blocks_give_eager_numbers_and_keep_names() -> None:
    """Compiled in place: the same state-dict keys, forward, input and parameter gradients, also at stashed weights
    (``functional_call``, a stage server's backward) and on another thread (a server's compute thread)."""
    torch.manual_seed(0)
    eager, compiled = middle(), middle()
    keys = list(compiled.state_dict())
    report = compile_stage(compiled, "on", CPU)
    assert report.enabled and report.blocks == 2 and report.first_call_s is None
    assert list(compiled.state_dict()) == keys and [n for n, _ in compiled.named_parameters()] == keys
    x, grad = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    with ThreadPoolExecutor(max_workers=1) as thread:
        got_x, got = thread.submit(stage_gradients, compiled, x, grad).result()
    assert report.first_call_s is not None and report.first_call_s > 0 and report.fields()["compile_s"] > 0
    want_x, want = stage_gradients(eager, x, grad)
    torch.testing.assert_close(got_x, want_x, rtol=1e-4, atol=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)
    stashed = {name: p.detach() + 0.01 for name, p in eager.named_parameters()}  # weights a forward ran on
    _, got = stage_gradients(compiled, x, grad, weights=stashed)
    _, want = stage_gradients(eager, x, grad, weights=stashed)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert all(block._compiled_call_impl is not None for block in compiled.blocks)  # still compiled


def test_a_failing_compile_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            raise RuntimeError("no C compiler")  # where inductor fails: at the first call

        return call

    monkeypatch.setattr(torch, "compile", broken)
    eager, stage = middle(), middle()
    report = compile_stage(stage, "on", CPU)
    assert report.enabled
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        torch.testing.assert_close(stage(x), eager(x))  # the failing call ran eagerly
        torch.testing.assert_close(stage(x), eager(x))
    assert not report.enabled and "no C compiler" in (report.error or "") and report.fields() == {}
    assert all(block._compiled_call_impl is None for block in stage.blocks)

    def refused(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("unsupported platform")  # where torch.compile refuses up front

    monkeypatch.setattr(torch.nn.Module, "compile", refused)
    report = compile_stage(middle(), "on", CPU)
    assert not report.enabled and "unsupported platform" in (report.error or "")


def test_fused_optimizers_and_pinned_copies_on_cuda_only() -> None:
    on = lambda device: SimpleNamespace(device=torch.device(device))  # a parameter's device, without a GPU
    assert fused_kwargs([on("cuda:0"), on("cuda:1")]) == {"fused": True}
    assert fused_kwargs([on("cpu")]) == {} and fused_kwargs([on("cuda"), on("cpu")]) == {} and fused_kwargs([]) == {}
    opt, _ = make_inner_optimizer(middle().parameters(), InnerOptimConfig())
    assert not opt.defaults["fused"]  # on a CPU: torch's default
    assert host_copy(CUDA).pinned and not host_copy(CPU).pinned  # batches go through pinned memory on CUDA only
    batch = (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
    assert all(a is b for a, b in zip(to_device(batch, CPU), batch, strict=True))


def test_compiled_microbatch_loss_is_a_device_tensor() -> None:
    model_stage = build_stage(TINY, 1, 0)
    assert isinstance(model_stage, EdgeStage)
    tokens = torch.randint(0, 256, (2, 16))
    loss = microbatch_loss(model_stage, [middle()], (tokens, tokens), inner_batch=2)
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0 and not loss.requires_grad
    assert all(p.grad is not None for p in trainable(model_stage))


class Reads:
    """Counts the host's reads of tensor values (``.item()``, ``float(t)``, ``.tolist()``): each waits for the GPU.

    Not torch.optim's own reads of its step counters: they are host tensors in the optimizers that read them
    (fused AdamW, chosen on CUDA, keeps them on the device and reads none)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count, self.inside = 0, False
        for name in ("item", "__float__", "tolist"):
            monkeypatch.setattr(torch.Tensor, name, self.counted(getattr(torch.Tensor, name)))

    def counted(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(tensor: torch.Tensor, *args: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if self.inside or caller.startswith("torch.optim"):  # float(t) calls t.item(): one read
                return original(tensor, *args)
            self.count, self.inside = self.count + 1, True
            try:
                return original(tensor, *args)
            finally:
                self.inside = False

        return read


def test_train_local_reads_the_device_once_per_inner_step_and_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 inner steps of 4 microbatches, logged every 4 steps: a read per inner step (its gradient norm), and per
    window the train loss and the validation loss (one read over both validation batches)."""
    cfg = derive_config(
        SwarmConfig(),
        {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 32,
         "stages.num_stages": 2, "train.seq_len": 32, "train.microbatch_size": 2, "train.inner_batch": 8},
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    sample = lambda: torch.randint(0, 256, (2, 33), generator=gen)
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = ((s[:, :-1], s[:, 1:]) for s in iter(sample, None))
    val = [(s[:, :-1], s[:, 1:]) for s in itertools.islice(iter(sample, None), 2)]
    records: list[dict[str, float]] = []
    reads = Reads(monkeypatch)
    train_centralized(cfg, batches, val, steps=8, log_every=4, on_log=records.append, compile="auto")
    steps, windows, microbatches = 8, 2, 32
    assert [r["step"] for r in records] == [4, 8] and "compile_s" not in records[0]
    assert reads.count <= steps + 2 * windows < microbatches, reads.count
    assert records[-1]["train_loss"] > 0


def test_a_compiled_servers_warm_up_makes_its_first_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """``server.warm_up``, run by a compiled stage server before it takes requests, reaches the compiled blocks:
    their first calls (the compile, timed into the report) happen there, not in a trainer's first request."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # compiles nothing, fast: the hooks still run
    server = StageServer(rpc_config(), 1)
    report = compile_stage(server.module, "on", CPU)
    assert report.enabled and report.first_call_s is None
    warm_up(server)
    assert report.first_call_s is not None and report.first_call_s > 0
