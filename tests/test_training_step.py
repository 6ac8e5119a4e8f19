"""One microbatch training step (swarm/model/step.py), three drivers: the runtime trainer with its stage servers
(in process, no network), the simulator's replicas, and the centralized baseline. On the same microbatches and seed
they must give the same gradients and, after an inner step, the same weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.config import SwarmConfig, TrainerOptions
from swarm.model.stages import EDGE_STAGE, to_model_state
from swarm.model.transformer import Transformer
from swarm.pipeline.boundary import Link, boundary_codecs
from swarm.pipeline.trainer import Trainer
from swarm.sim.centralized import train_centralized
from swarm.sim.centralized import train_microbatch as centralized_microbatch
from swarm.sim.simulate import Replica, make_replica
from swarm.sim.simulate import train_microbatch as simulated_microbatch
from swarmtest.configs import BATCH, SEQ, tiny_config
from swarmtest.fakes import DirectStages

STAGES = 2
FP32 = {"activations": "fp32", "gradients": "fp32"}
Batch = tuple[torch.Tensor, torch.Tensor]
Tensors = dict[str, torch.Tensor]  # by the full model's parameter names


def config(*, clip: float, codecs: dict[str, str] = FP32) -> SwarmConfig:
    """Two microbatches per inner step, so gradients accumulate before it."""
    return tiny_config(
        stages=STAGES,
        steps=10,
        train={"inner_batch": 2 * BATCH},
        inner={"grad_clip": clip, "warmup_steps": 1},
        codecs=codecs,
    )


def microbatches(n: int = 2) -> list[Batch]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (n, BATCH, SEQ + 1), generator=g)
    return [(x[:, :-1], x[:, 1:]) for x in tokens]


def by_model_name(cfg: SwarmConfig, stages: dict[int, torch.nn.Module], what: str) -> Tensors:
    """Parameters (``what="data"``) or gradients (``"grad"``; none for a stage off the path) of stages 0..S under the full model's names."""
    return {
        name: getattr(p, what).clone()
        for stage, module in stages.items()
        for name, p in to_model_state(cfg.model, STAGES, stage, dict(module.named_parameters())).items()
        if getattr(p, what) is not None
    }


def assert_same(a: Tensors, b: Tensors) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: max difference {(a[name] - b[name]).abs().max().item():.3g}"


def modules(trainer: Trainer, net: DirectStages) -> dict[int, torch.nn.Module]:
    """Stages 0..S of a trainer and its stage servers."""
    return {EDGE_STAGE: trainer.module, **{s.stage: s.module for s in net.servers.values()}}


def runtime(
    cfg: SwarmConfig, batches: list[Batch], path: list[int], *, in_loop: bool = False
) -> tuple[Tensors | None, Tensors]:
    """(gradients after the first microbatch, weights after all of them) of a trainer driving local stage servers;
    ``in_loop``: through ``Trainer.train`` (both microbatches in flight at once), gradients not looked at."""
    net = DirectStages.of(cfg, {f"stage{s}": s for s in range(1, STAGES + 1)})  # no envelope, no network
    trainer = Trainer(cfg, net, net.router, options=TrainerOptions(in_flight=2))
    net.router.draw_path = lambda paths: list(path)  # type: ignore[method-assign]  # every microbatch takes this path

    async def scenario() -> Tensors | None:
        if in_loop:
            await trainer.train(iter(batches), steps=1)
            return None
        assert await trainer.train_microbatch(*batches[0]) is not None
        grads = by_model_name(cfg, modules(trainer, net), "grad")
        for batch in batches[1:]:
            assert await trainer.train_microbatch(*batch) is not None
        return grads

    try:
        grads = asyncio.run(scenario())
    finally:
        trainer.shutdown()
        net.shutdown()
    assert trainer.inner_steps == 1 and all(s.inner_steps == (s.stage in path) for s in net.servers.values())
    return grads, by_model_name(cfg, modules(trainer, net), "data")


def simulated(cfg: SwarmConfig, batches: list[Batch], path: list[int]) -> tuple[Tensors, Tensors]:
    """The same through the simulator's replicas and link."""
    replicas: dict[int, Replica] = {
        s: make_replica(cfg, s, cfg.inner.total_steps, with_outer=False) for s in range(STAGES + 1)
    }
    link = Link(*boundary_codecs(cfg))
    modules = {s: r.module for s, r in replicas.items()}
    simulated_microbatch(replicas[EDGE_STAGE], [replicas[s] for s in path], batches[0], link)
    grads = by_model_name(cfg, modules, "grad")
    for batch in batches[1:]:
        simulated_microbatch(replicas[EDGE_STAGE], [replicas[s] for s in path], batch, link)
    assert all(r.inner.steps == 1 for s, r in replicas.items() if s == EDGE_STAGE or s in path)
    return grads, by_model_name(cfg, modules, "data")


def centralized(cfg: SwarmConfig, batches: list[Batch]) -> tuple[Tensors, Tensors]:
    """The same in the centralized baseline (full path, no codec, one optimizer)."""
    model = Transformer(cfg.model)
    centralized_microbatch(model, batches[0], num_stages=STAGES, inner_batch=cfg.train.inner_batch)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]  # all set by the step
    trained = train_centralized(cfg, iter(batches), [batches[0]], steps=1)
    return grads, {name: p.detach().clone() for name, p in trained.named_parameters()}


def test_runtime_simulator_and_centralized_take_the_same_step() -> None:
    cfg = config(clip=0.0)  # the centralized baseline clips the whole model at once, the swarm each stage: off here
    batches = microbatches()
    grads, weights = runtime(cfg, batches, [1, 2])
    sim_grads, sim_weights = simulated(cfg, batches, [1, 2])
    central_grads, central_weights = centralized(cfg, batches)
    assert grads is not None
    assert_same(grads, sim_grads)
    assert_same(grads, central_grads)
    assert_same(weights, sim_weights)
    assert_same(weights, central_weights)
    assert not torch.equal(weights["lm_head.weight"], Transformer(cfg.model).lm_head.weight)  # a step was taken
    _, loop_weights = runtime(cfg, batches, [1, 2], in_loop=True)
    assert_same(loop_weights, weights)


@pytest.mark.parametrize("path", [[1, 2], [2, 1], [2]], ids=["full", "swap", "skip"])
@pytest.mark.parametrize("codecs", [FP32, {}], ids=["fp32", "default-codecs"])
def test_runtime_and_simulator_agree_on_any_path_with_clipping_and_lossy_codecs(
    path: list[int], codecs: dict[str, str]
) -> None:
    cfg = config(clip=0.5, codecs=codecs)
    batches = microbatches()
    grads, weights = runtime(cfg, batches, path)
    sim_grads, sim_weights = simulated(cfg, batches, path)
    assert grads is not None
    assert_same(grads, sim_grads)
    assert_same(weights, sim_weights)


def test_a_microbatch_weighs_its_share_of_the_inner_batch() -> None:
    """Accumulating the microbatches of an inner batch gives the gradient of the inner batch's mean loss."""
    cfg = config(clip=0.0)
    batches = microbatches()
    model = Transformer(cfg.model)
    for batch in batches:
        centralized_microbatch(model, batch, num_stages=STAGES, inner_batch=cfg.train.inner_batch)
    accumulated = {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]  # all set
    model.zero_grad()
    inputs, targets = (torch.cat(t) for t in zip(*batches))
    torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(accumulated[name], p.grad, rtol=1e-5, atol=1e-7)
