"""A stage server that keeps its forward's graph for the backward instead of recomputing it (``--keep-graph-mb``).

Its gradients equal the recompute's, at a real shape and in bf16; the budget bounds the graphs kept (0: none); weights
moved between forward and backward drop the graph (recomputed at the stashed weights); evicting an entry frees its
graph; bad gradients are still refused; and each request's time split reaches ``info()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from compress.codecs import get_codec
from optim.inner import GradNormScreen
from swarm.config import SwarmConfig
from swarm.errors import ConfigError
from swarm.hardware import Precision
from swarm.node.config import PeerConfig
from swarm.pipeline.cache import ActivationCache, CacheEntry
from swarm.pipeline.graphs import GraphSizer, KeptGraph, graph_budget_bytes
from swarm.pipeline.protocol import Backward, Forward
from swarm.pipeline.server import StageServer, warm_up
from swarm.pipeline.timing import SPLIT_FIELDS, synchronize
from swarm.rpc.servicer import RequestError
from swarmtest.configs import FP32_BOUNDARIES, RPC_BATCH, RPC_SEQ, RPC_WIDTH, rpc_config, tiny_config

FP32 = get_codec("fp32")
BIG_MB = 1 << 14  # a budget no test shape fills


def no_steps(cfg: SwarmConfig) -> SwarmConfig:
    """``cfg`` whose inner batch no test fills: the weights stay put, and the gradients stay in ``.grad``."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, inner_batch=1000 * cfg.train.microbatch_size))


def forward(server: StageServer, mb: str, x: torch.Tensor, peer: str = "p") -> torch.Tensor:
    reply = asyncio.run(server.forward(peer, Forward(mb=mb, stage=1, prev_stage=0, x=FP32.encode(x))))
    return FP32.decode(reply)


def backward(server: StageServer, mb: str, grad: torch.Tensor, peer: str = "p") -> torch.Tensor:
    return FP32.decode(asyncio.run(server.backward(peer, Backward(mb=mb, stage=1, grad=FP32.encode(grad)))))


def grads(server: StageServer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in server.module.parameters() if p.grad is not None]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], *, atol: float = 0.0) -> None:
    assert len(a) == len(b) > 0
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=0.0, atol=atol)


def pair(cfg: SwarmConfig, **kept: Any) -> tuple[StageServer, StageServer]:
    """A server keeping graphs and one recomputing, on the same seeded weights."""
    return StageServer(cfg, 1, keep_graph_mb=kept.pop("keep_graph_mb", BIG_MB), **kept), StageServer(cfg, 1)


@pytest.mark.timeout(900)
def test_kept_graph_gradients_equal_the_recompute_at_a_real_shape() -> None:
    """d_model 768, one block, 8 x 1024: the same input gradient and parameter gradients, with one forward fewer."""
    width, seq, batch = 768, 1024, 8
    cfg = no_steps(
        tiny_config(
            stages=2,
            model={"d_model": width, "n_layers": 2, "n_heads": 12, "max_seq_len": seq},
            train={"seq_len": seq, "microbatch_size": batch, "inner_batch": batch},
            codecs=FP32_BOUNDARIES,
        )
    )
    kept, recomputed = pair(cfg)
    torch.manual_seed(0)
    x, g = torch.randn(batch, seq, width), torch.randn(batch, seq, width) * 1e-3
    y = forward(kept, "m", x)
    assert kept.cache.graph_bytes > 10 * x.nbytes  # a block's saved activations: many times its input
    assert torch.equal(y, forward(recomputed, "m", x))
    grad_x = backward(kept, "m", g)
    assert kept.cache.graph_bytes == 0 and kept.counters["graph_kept_backward"] == 1
    assert torch.equal(grad_x, backward(recomputed, "m", g))  # the same ops on the same values: bit for bit
    assert recomputed.counters["graph_kept_backward"] == 0
    assert_same(grads(kept), grads(recomputed))
    kept.shutdown()
    recomputed.shutdown()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_kept_graph_gives_the_recomputes_gradients_and_the_time_split_says_which(precision: Precision) -> None:
    cfg = no_steps(rpc_config())
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    kept, recomputed = pair(cfg)
    torch.manual_seed(0)
    for k in range(3):
        x, g = torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH), torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH)
        assert torch.equal(forward(kept, f"m{k}", x), forward(recomputed, f"m{k}", x))
        assert torch.equal(backward(kept, f"m{k}", g), backward(recomputed, f"m{k}", g))
    assert_same(grads(kept), grads(recomputed))
    assert kept.counters["graph_kept_backward"] == 3 and kept.counters["graph_budget_recompute"] == 0
    for server, recomputes in ((kept, 0.0), (recomputed, 1.0)):
        split = server.info()["time_split"]
        assert set(split) == {"forward", "backward"}
        assert split["backward"]["recomputed"] == recomputes and split["backward"]["requests"] == 3
        assert all(split[kind][name] >= 0.0 for kind in split for name in SPLIT_FIELDS)
        assert split["forward"]["compute_s"] > 0.0 and split["backward"]["decode_s"] > 0.0
    kept.shutdown()
    recomputed.shutdown()


def test_budget_zero_never_keeps_a_graph() -> None:
    server = StageServer(no_steps(rpc_config()), 1, keep_graph_mb=0)
    x = torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH)
    forward(server, "m", x)
    entry = server.cache.pop("p", "m")
    assert entry is not None and entry.graph is None and server.cache.graph_bytes == 0
    assert server.cache.graphs_released == 0 and server.graph_sizer.bytes_per_token == 0.0  # none built, even at first
    assert server.info()["graphs"]["budget_mb"] == 0.0
    server.shutdown()


def test_a_small_budget_keeps_graphs_up_to_it_then_recomputes() -> None:
    kept, recomputed = pair(no_steps(rpc_config()))
    torch.manual_seed(0)
    xs = [torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH) for _ in range(5)]
    forward(kept, "m0", xs[0])  # measured
    one = kept.cache.graph_bytes
    assert one > 0
    kept.cache.max_graph_bytes = int(2.5 * one)  # room for two graphs
    for k, x in enumerate(xs[1:], 1):
        forward(kept, f"m{k}", x)
        assert kept.cache.graph_bytes <= kept.cache.max_graph_bytes
    assert kept.cache.graph_bytes == 2 * one  # m0 and m1 kept theirs; m2..m4 did not fit
    for k, x in enumerate(xs):
        forward(recomputed, f"m{k}", x)
        g = torch.randn_like(x)
        assert torch.equal(backward(kept, f"m{k}", g), backward(recomputed, f"m{k}", g))
    assert kept.counters["graph_kept_backward"] == 2 and kept.counters["graph_budget_recompute"] == 3
    assert kept.info()["time_split"]["backward"]["recomputed"] == pytest.approx(3 / 5)
    assert_same(grads(kept), grads(recomputed))
    kept.shutdown()
    recomputed.shutdown()


def nudge(server: StageServer) -> Callable[[], None]:
    """An outer install's in-place move of every weight."""

    def install() -> None:
        with torch.no_grad():
            for p in server.module.parameters():
                p.add_(0.01)

    return install


@pytest.mark.parametrize("forward_between", [False, True])
@pytest.mark.parametrize("move", ["inner step", "outer install"])
def test_weights_moved_since_the_forward_void_its_graph_and_it_recomputes_at_the_stashed_weights(
    move: str, forward_between: bool
) -> None:
    """A's forward keeps its graph; B and C's backwards fill an inner batch (a step), or an install moves the weights:
    A's backward recomputes at the weights its forward ran on and gets the recomputing server's gradients. A forward
    in between (D) drops the void graphs at once; C, whose forward came when B's backward was due to step, kept none."""
    cfg = rpc_config() if move == "inner step" else no_steps(rpc_config())  # rpc_config: a step every 2 microbatches
    kept, recomputed = pair(cfg)
    torch.manual_seed(0)
    xs = {mb: torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH) for mb in "ABCD"}
    gs = {mb: torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH) for mb in "ABC"}
    for server in (kept, recomputed):
        for mb in "ABC":
            forward(server, mb, xs[mb])
        if move == "inner step":
            backward(server, "B", gs["B"])
            backward(server, "C", gs["C"])
        else:
            server.change_weights(nudge(server), "moved")
        if forward_between:
            forward(server, "D", xs["D"])
    assert kept.inner_steps == (1 if move == "inner step" else 0)
    assert kept.cache.graphs_released == (0 if not forward_between else 1 if move == "inner step" else 3)
    assert torch.equal(backward(kept, "A", gs["A"]), backward(recomputed, "A", gs["A"]))
    assert_same(grads(kept), grads(recomputed))
    assert kept.counters["graph_moved_recompute"] == 1 and kept.counters["stashed_backward"] == 1
    assert kept.counters["graph_step_due_recompute"] == (1 if move == "inner step" else 0)  # C's
    kept.shutdown()
    recomputed.shutdown()


def graph_entry(nbytes: int) -> tuple[CacheEntry, weakref.ref[torch.Tensor]]:
    x = torch.randn(4, requires_grad=True)
    y = (x * 2).exp()  # a graph that saves a tensor
    entry = CacheEntry(
        x=torch.zeros(10), tokens=None, forward_s=0.0, weights=0, graph=KeptGraph(x=x, y=y, nbytes=nbytes)
    )
    return entry, weakref.ref(y)


def test_evicting_an_entry_frees_its_graph_and_its_bytes() -> None:
    cache = ActivationCache(max_items=8, max_bytes=10_000, share=4, max_graph_bytes=10_000)  # 2 entries per owner
    entries = [graph_entry(1000) for _ in range(3)]
    cache.put("p", 0, entries[0][0])
    cache.put("p", 1, entries[1][0])
    assert cache.graph_bytes == 2000 and cache.nbytes == 2080
    cache.put("p", 2, entries[2][0])  # over the owner's 2 items: entry 0 evicted
    assert cache.evicted == 1 and cache.graph_bytes == 2000 and cache.nbytes == 2080
    first, freed = entries.pop(0)
    assert first.graph is None
    del first
    gc.collect()
    assert freed() is None  # the evicted graph's memory is gone, not only uncounted
    popped = cache.pop("p", 1)
    assert popped is not None and popped.graph is not None and cache.graph_bytes == 1000


def test_over_the_graph_budget_the_biggest_holder_yields_its_oldest_graph_and_keeps_its_input() -> None:
    cache = ActivationCache(max_items=64, max_bytes=100_000, share=1, max_graph_bytes=3000)
    for k in range(3):
        cache.put("flood", k, graph_entry(1000)[0])
    assert not cache.admits_graph("flood", 1000)  # full, and no one holds more than it
    assert cache.admits_graph("honest", 1000)  # the flooder holds more: it yields
    cache.put("honest", 0, graph_entry(1000)[0])
    assert cache.graph_bytes == 3000 and cache.graphs_released == 1 and len(cache) == 4
    oldest = cache.pop("flood", 0)
    assert oldest is not None and oldest.graph is None  # its input stays for the recompute
    assert not cache.admits_graph("honest", 4000)  # never over the budget, however small the others


def test_the_server_still_refuses_a_bad_gradient_from_a_kept_graph() -> None:
    server = StageServer(no_steps(rpc_config()), 1, keep_graph_mb=BIG_MB)
    server.screen = GradNormScreen(probation=0)  # the sender's norms count at once
    torch.manual_seed(0)
    for k in range(3):
        forward(server, f"m{k}", torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH))
        backward(server, f"m{k}", torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH))
    before = grads(server)
    forward(server, "bad", torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH))
    with pytest.raises(RequestError, match="gradient refused"):
        backward(server, "bad", torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH) * 1e4)
    assert server.counters["refused_gradient"] == 1 and server.counters["graph_kept_backward"] == 4
    assert_same(grads(server), before)  # nothing of it accumulated
    server.shutdown()


def test_the_budget_option_and_its_auto_default() -> None:
    assert PeerConfig().keep_graph_mb is None  # auto
    assert graph_budget_bytes(None, available=8 << 30) == 2 << 30
    assert graph_budget_bytes(0, available=8 << 30) == 0
    assert graph_budget_bytes(3, available=8 << 30) == 3 << 20
    with pytest.raises(ConfigError, match="keep_graph_mb"):
        PeerConfig(keep_graph_mb=-1)
    sizer = GraphSizer(measure=2)
    assert sizer.predict(100) is None and sizer.measuring
    sizer.observe(tokens=100, nbytes=1000)
    sizer.observe(tokens=10, nbytes=200)
    assert sizer.predict(50) == 1000 and not sizer.measuring  # the most bytes per token seen


def test_synchronize_waits_for_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", calls.append)
    synchronize(torch.device("cpu"))
    assert calls == []  # the CPU's timing stays free
    synchronize(torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]


def test_a_tensor_already_on_the_device_is_not_copied_nor_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import swarm.pipeline.timing as timing

    waits: list[torch.device] = []
    monkeypatch.setattr(timing, "synchronize", waits.append)
    times, x = timing.RequestTimes(), torch.randn(2, 3)
    assert timing.timed_copy(x, torch.device("cpu"), times, time.perf_counter) is x  # decoded onto the device already
    assert waits == [] and times.copy_s == 0.0
    timing.timed_copy(x, torch.device("meta"), times, time.perf_counter)  # a real move: timed, and waited for
    assert waits == [torch.device("meta")] and times.copy_s > 0.0


def test_a_warm_up_runs_every_kind_of_call_and_counts_nothing() -> None:
    """``server.warm_up`` (a compiled server's, before it takes requests): its forward and backward of each kind
    leave weights, gradients, steps, cache and graph measurements as they were."""
    server = StageServer(no_steps(rpc_config()), 1, keep_graph_mb=BIG_MB)
    weights = {name: p.detach().clone() for name, p in server.module.named_parameters()}
    before = (server.inner_steps, server.inner.samples, len(server.cache), server.graph_sizer.measuring, grads(server))
    assert warm_up(server) > 0
    after = (server.inner_steps, server.inner.samples, len(server.cache), server.graph_sizer.measuring, grads(server))
    assert before == after == (0, 0, 0, True, [])
    for name, p in server.module.named_parameters():
        assert torch.equal(p, weights[name]), name


def test_an_install_queued_behind_a_forward_voids_its_graph_as_one_after_it_was_filed() -> None:
    """The compute thread runs an outer install queued behind B's forward before the event loop files B: B's entry
    still says the weights B ran on, so its backward differentiates at them (stashed), as if the install came later,
    not through its kept graph of weights since moved in place (autograd refused it, a failed request)."""
    raced, later = pair(no_steps(rpc_config()))
    torch.manual_seed(0)
    xs = {mb: torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH) for mb in "AB"}
    g = torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH)
    forward_at_step = raced._forward_at_step

    def install_right_after(*args: Any) -> Any:
        result = forward_at_step(*args)
        if args[1]:  # B's forward, which keeps its graph: the install the executor took next
            raced.change_weights(nudge(raced), "moved")
        return result

    forward(raced, "A", xs["A"])
    forward(later, "A", xs["A"])
    raced._forward_at_step = install_right_after  # type: ignore[method-assign]
    forward(raced, "B", xs["B"])
    forward(later, "B", xs["B"])
    later.change_weights(nudge(later), "moved")
    assert raced.weights_epoch == later.weights_epoch == 1
    assert torch.equal(backward(raced, "B", g), backward(later, "B", g))
    assert_same(grads(raced), grads(later))
    assert raced.counters["stashed_backward"] == later.counters["stashed_backward"] == 1
    assert raced.counters["graph_kept_backward"] == 0
    raced.shutdown()
    later.shutdown()
