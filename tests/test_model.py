"""The model, its split into stages, and the subspace-constrained residual stream."""

import contextlib
from collections.abc import Iterator

import pytest
import torch

from compress.codecs import get_codec
from optim.config import InnerOptimConfig
from optim.inner import clip_and_step, make_inner_optimizer
from swarm.config import SwarmConfig, derive_config
from swarm.model.sizing import stage_parameters
from swarm.model.stages import (
    EdgeStage,
    MiddleStage,
    assemble_model,
    build_stage,
    run_path,
    split_layers,
    split_model,
    to_model_state,
)
from swarm.model.transformer import INIT_CHUNK, ModelConfig, Transformer, init_std, loss_fn, subspace_basis
from swarm.outer.state import weights_hash
from swarm.pipeline.server import StageServer

TINY = dict(d_model=64, n_layers=6, n_heads=4, max_seq_len=32)


def tokens(batch: int = 3, seq: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n_layers,num_stages", [(8, 4), (8, 3), (6, 6), (5, 1), (7, 2)])
def test_split_layers_is_contiguous_and_balanced(n_layers: int, num_stages: int) -> None:
    ranges = split_layers(n_layers, num_stages)
    assert [i for r in ranges for i in r] == list(range(n_layers))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_split_layers_rejects_more_stages_than_blocks() -> None:
    with pytest.raises(ValueError, match="num_stages"):
        split_layers(4, 5)


@pytest.mark.parametrize("subspace_rank", [0, 16])
def test_stages_in_order_reproduce_the_full_model(subspace_rank: int) -> None:
    model = Transformer(ModelConfig(**TINY, subspace_rank=subspace_rank))
    edge, *middles = split_model(model, 3)
    x = tokens()
    staged = run_path(edge, dict(enumerate(middles, 1)), [1, 2, 3], x)
    assert torch.equal(staged, model(x))


def test_independently_built_stages_match_the_full_model() -> None:
    cfg = ModelConfig(**TINY)
    stages = {i: build_stage(cfg, 3, i) for i in range(4)}
    x = tokens()
    assert torch.equal(run_path(stages[0], {i: stages[i] for i in (1, 2, 3)}, [1, 2, 3], x), Transformer(cfg)(x))


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_a_stage_built_alone_on_any_thread_count_is_that_part_of_the_whole_model() -> None:
    # gate_up holds 1.4M values: two INIT_CHUNKs, each drawn from its own seed, on whichever thread
    cfg = ModelConfig(d_model=512, n_layers=4, n_heads=8, max_seq_len=32, init_seed=3)
    assert 2 * cfg.ffn_hidden * cfg.d_model > INIT_CHUNK
    whole = dict(Transformer(cfg).named_parameters())
    for stage in range(3):
        with torch_threads(1):
            alone = build_stage(cfg, 2, stage)
        with torch_threads(3):
            other = build_stage(cfg, 2, stage)
        named = to_model_state(cfg, 2, stage, dict(alone.named_parameters()))
        assert all(torch.equal(p, whole[name]) for name, p in named.items())
        assert all(torch.equal(a, b) for a, b in zip(alone.parameters(), other.parameters(), strict=True))
    reseeded = dict(Transformer(ModelConfig(d_model=512, n_layers=4, n_heads=8, max_seq_len=32)).named_parameters())
    assert not torch.equal(reseeded["blocks.0.attn.qkv.weight"], whole["blocks.0.attn.qkv.weight"])


def test_two_replicas_of_a_125m_stage_server_start_from_bit_identical_seeded_weights() -> None:
    """The stage server's own start path (``StageServer`` builds its stage), at a real size: 6 blocks of the 125m preset,
    42.5M parameters, on 1 and on 2 threads. The weights keep the model's init: N(0, 0.02²), the residual outputs'
    scaled by 1/sqrt(2 n_layers), norm gains 1."""
    cfg = derive_config(SwarmConfig(), {"model.preset": "125m", "stages.num_stages": 2})
    replicas = []
    for threads in (1, 2):
        with torch_threads(threads):
            server = StageServer(cfg, 2)
        server.shutdown()
        replicas.append(dict(server.module.named_parameters()))
    first, second = replicas
    assert sum(p.numel() for p in first.values()) == stage_parameters(cfg.model, 2, 2) > 42e6
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert weights_hash(first, threads=1) == weights_hash(second, threads=2)
    for name, p in to_model_state(cfg.model, 2, 2, first).items():
        if p.ndim == 1:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        std = init_std(cfg.model, name)
        assert abs(p.std().item() / std - 1) < 0.01 and abs(p.mean().item()) < 0.01 * std, name
    assert init_std(cfg.model, "blocks.6.mlp.down.weight") == pytest.approx(0.02 / 24**0.5)


def test_skip_and_swap_paths_run_and_differ_from_the_full_path() -> None:
    model = Transformer(ModelConfig(**TINY))
    edge, *middles = split_model(model, 3)
    by_id = dict(enumerate(middles, 1))
    x = tokens()
    full = run_path(edge, by_id, [1, 2, 3], x)
    for path in ([1, 3], [2, 1, 3], [1, 3, 2], [2]):
        out = run_path(edge, by_id, path, x)
        assert out.shape == full.shape and torch.isfinite(out).all()
        assert not torch.allclose(out, full)
    loss_fn(run_path(edge, by_id, [2, 1, 3], x), x).backward()  # gradients flow along a swapped path
    assert all(p.grad is not None for p in by_id[1].parameters())


def test_stage_state_dicts_load_back_into_a_full_model() -> None:
    cfg = ModelConfig(**TINY, init_seed=7)
    trained = Transformer(cfg)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # differ from the seeded init
    states = {i: stage.state_dict() for i, stage in enumerate(split_model(trained, 3))}
    assert set(states[1]) <= {k for k in states[1] if k.startswith("blocks.")}  # local block indices
    rebuilt = assemble_model(cfg, 3, states)
    x = tokens()
    assert torch.equal(rebuilt(x), trained(x))
    with pytest.raises(ValueError, match="stages \\[2\\]"):
        assemble_model(cfg, 3, {i: s for i, s in states.items() if i != 2})


def test_edge_stage_holds_only_embedding_norm_and_head() -> None:
    edge = EdgeStage(Transformer(ModelConfig(**TINY)))
    assert {k.split(".")[0] for k in edge.state_dict()} == {"embed", "norm", "lm_head"}
    assert isinstance(build_stage(ModelConfig(**TINY), 3, 2), MiddleStage)


def subspace_residual(model: Transformer, x: torch.Tensor) -> tuple[float, float]:
    """Max |h − rebuild(h)| at every block boundary, and max |h| for scale."""
    codec = get_codec("subspace", basis=model.embed.basis, table=model.embed.table)  # what a stage boundary sends
    h, worst, scale = model.embed(x), 0.0, 0.0
    for block in model.blocks:
        h = block(h, model.rope_cos, model.rope_sin)
        rebuilt = codec.decode(codec.encode(h, tokens=x))
        worst, scale = max(worst, (rebuilt - h).abs().max().item()), max(scale, h.abs().max().item())
    return worst, scale


def test_subspace_hidden_state_is_exact_before_and_after_optimizer_steps() -> None:
    cfg = ModelConfig(**TINY, subspace_rank=8)
    model = Transformer(cfg)
    x = tokens()
    err, scale = subspace_residual(model, x)
    assert err <= 1e-6 * scale
    opt, sched = make_inner_optimizer(model.parameters(), InnerOptimConfig(lr=1e-2, warmup_steps=0))
    for _ in range(5):
        loss_fn(model(x), x).backward()
        clip_and_step(opt, sched, 1.0)
    err, scale = subspace_residual(model, x)
    assert scale > 0.05 and err <= 1e-6 * scale
    codec = get_codec("subspace", basis=model.embed.basis, table=model.embed.table)
    assert codec.payload_bytes((*x.shape, cfg.d_model)) < get_codec("fp32").payload_bytes((*x.shape, cfg.d_model)) / 4


def test_unconstrained_hidden_state_is_not_in_a_random_subspace() -> None:
    """The exactness check above can fail: an unconstrained model's hidden state leaves span(U)."""
    cfg = ModelConfig(**TINY, subspace_rank=8)
    basis, table = subspace_basis(cfg)
    free = Transformer(ModelConfig(**TINY))
    x = tokens()
    h = free.run_blocks(free.embed(x))
    with pytest.raises(ValueError, match="not in the subspace"):
        get_codec("subspace", basis=basis, table=table).encode(h, tokens=x)
