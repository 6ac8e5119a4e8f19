"""CheckFree / CheckFree+ recovery: the merge formula, the plans, block alignment, and a strict load."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from optim.config import InnerOptimConfig
from swarm.model.stages import build_stage, split_layers
from swarm.model.transformer import ModelConfig
from swarm.recovery.checkfree import (
    RECOVERY_LR_SCALE,
    NoRecoverySource,
    RecoveryPlan,
    apply_recovery,
    checkfree_merge,
    make_recovery_optimizer,
    recovery_source,
)


def stage_state(*blocks: list[float]) -> dict[str, torch.Tensor]:
    """A toy middle-stage state dict: block j holds one weight with values ``blocks[j]``."""
    return {f"blocks.{j}.w": torch.tensor(values) for j, values in enumerate(blocks)}


# ---- the merge formula ----------------------------------------------------------------------------------


def test_merge_golden_numbers():
    prev, next_ = stage_state([1.0, 2.0]), stage_state([3.0, 6.0])
    merged = checkfree_merge(prev, next_, grad_norm_prev=1.0, grad_norm_next=3.0, num_blocks=1)
    # a = 3 + 1e-4, b = 1 + 1e-4: (3.0001·[3, 6] + 1.0001·[1, 2]) / 4.0002
    assert merged["blocks.0.w"].tolist() == pytest.approx([10.0004 / 4.0002, 20.0008 / 4.0002], rel=1e-6)
    assert merged["blocks.0.w"].dtype == torch.float32 and set(merged) == {"blocks.0.w"}


@pytest.mark.parametrize("norm", [0.0, 0.5, 7.0])
def test_equal_gradient_norms_give_the_plain_average(norm):
    merged = checkfree_merge(stage_state([1.0, -4.0]), stage_state([3.0, 2.0]), norm, norm, num_blocks=1)
    assert merged["blocks.0.w"].tolist() == pytest.approx([2.0, -1.0])


def test_the_larger_the_next_gradient_norm_the_closer_to_the_next_stage():
    prev, next_ = stage_state([0.0]), stage_state([1.0])
    values = [
        checkfree_merge(prev, next_, 1.0, g, num_blocks=1)["blocks.0.w"].item() for g in (0.0, 0.5, 1.0, 4.0, 100.0)
    ]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert values[0] == pytest.approx(1e-4 / 1.0002) and values[-1] == pytest.approx(100.0001 / 101.0002)


def test_neighbours_with_fewer_blocks_contribute_their_last_block():
    prev, next_ = stage_state([0.0], [2.0], [4.0]), stage_state([10.0])  # 3 blocks and 1 block
    merged = checkfree_merge(prev, next_, 0.0, 0.0, num_blocks=2)
    assert set(merged) == {"blocks.0.w", "blocks.1.w"}  # prev's extra block 2 is ignored
    assert merged["blocks.0.w"].item() == pytest.approx(5.0)  # (0 + 10) / 2
    assert merged["blocks.1.w"].item() == pytest.approx(6.0)  # (2 + 10) / 2: next repeats its last block


def test_mismatched_neighbours_and_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"blocks\.0\.w: the sources' shapes differ: \[\(3,\), \(2,\)\]"):
        checkfree_merge(stage_state([1.0, 2.0]), stage_state([1.0, 2.0, 3.0]), 1.0, 1.0, num_blocks=1)
    with pytest.raises(ValueError, match="different tensors"):
        checkfree_merge(stage_state([1.0]), {"blocks.0.v": torch.zeros(1)}, 1.0, 1.0, num_blocks=1)
    with pytest.raises(ValueError, match="not a middle-stage key"):
        checkfree_merge(stage_state([1.0]), {"embed.weight": torch.zeros(1)}, 1.0, 1.0, num_blocks=1)
    with pytest.raises(ValueError, match=r"blocks 0..n-1.*\[0, 2\]"):
        checkfree_merge(
            stage_state([1.0]), {"blocks.0.w": torch.zeros(1), "blocks.2.w": torch.zeros(1)}, 1.0, 1.0, num_blocks=1
        )
    with pytest.raises(ValueError, match="grad_norm_next"):
        checkfree_merge(stage_state([1.0]), stage_state([1.0]), 1.0, float("nan"), num_blocks=1)


# ---- plans ------------------------------------------------------------------------------------------------


def test_interior_stages_merge_their_two_neighbours():
    assert recovery_source(3, 5, swaps_enabled=False) == RecoveryPlan(stage=3, sources=(2, 4), kind="merge")
    assert recovery_source(2, 3, swaps_enabled=True) == RecoveryPlan(stage=2, sources=(1, 3), kind="merge")


@pytest.mark.parametrize("swaps, kind", [(True, "copy-swap-partner"), (False, "copy-neighbour")])
def test_edge_middle_stages_copy_their_only_neighbour(swaps, kind):
    assert recovery_source(1, 4, swaps_enabled=swaps) == RecoveryPlan(stage=1, sources=(2,), kind=kind)
    assert recovery_source(4, 4, swaps_enabled=swaps) == RecoveryPlan(stage=4, sources=(3,), kind=kind)
    assert recovery_source(2, 2, swaps_enabled=swaps) == RecoveryPlan(stage=2, sources=(1,), kind=kind)


def test_a_single_middle_stage_or_the_edge_stage_cannot_be_rebuilt_from_neighbours():
    with pytest.raises(NoRecoverySource, match="live replica.*re-initialise"):
        recovery_source(1, 1, swaps_enabled=True)
    with pytest.raises(ValueError, match="edge stage"):
        recovery_source(0, 4, swaps_enabled=True)
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        recovery_source(5, 4, swaps_enabled=True)


def test_apply_recovery_fetches_exactly_the_planned_sources():
    states = {1: (stage_state([0.0]), 3.0), 2: (stage_state([5.0]), 0.0), 3: (stage_state([4.0]), 1.0)}
    fetched: list[int] = []

    def fetch(stage: int):
        fetched.append(stage)
        return states[stage]

    merged = apply_recovery(recovery_source(2, 3, swaps_enabled=True), fetch, num_blocks=1)
    assert fetched == [1, 3]
    assert merged["blocks.0.w"].item() == pytest.approx((1.0001 * 4.0 + 3.0001 * 0.0) / 4.0002)
    fetched.clear()
    copied = apply_recovery(recovery_source(3, 3, swaps_enabled=True), fetch, num_blocks=1)
    assert fetched == [2] and copied["blocks.0.w"].item() == 5.0
    assert copied["blocks.0.w"] is not states[2][0]["blocks.0.w"]  # a copy: training it leaves the source alone


# ---- the rebuilt stage is a working stage ---------------------------------------------------------------------


@pytest.mark.parametrize("n_layers, num_stages", [(7, 3), (7, 4), (8, 4), (3, 2)])
def test_every_rebuilt_stage_loads_strictly_into_build_stage(n_layers, num_stages):
    cfg = ModelConfig(d_model=32, n_layers=n_layers, n_heads=2, max_seq_len=16)
    trained = {  # stand-ins for trained neighbours: a different seed for each stage
        s: (build_stage(dataclasses.replace(cfg, init_seed=s), num_stages, s).state_dict(), float(s))
        for s in range(1, num_stages + 1)
    }
    sizes = [len(r) for r in split_layers(n_layers, num_stages)]
    for stage in range(1, num_stages + 1):
        plan = recovery_source(stage, num_stages, swaps_enabled=True)
        state = apply_recovery(plan, trained.__getitem__, num_blocks=sizes[stage - 1])
        rebuilt = build_stage(cfg, num_stages, stage)
        rebuilt.load_state_dict(state, strict=True)
        source = trained[plan.sources[0]][0]
        if plan.kind != "merge":  # a copy: block j is the partner's block min(j, n−1)
            last = sizes[plan.sources[0] - 1] - 1
            for j in range(sizes[stage - 1]):
                assert torch.equal(
                    state[f"blocks.{j}.mlp.down.weight"], source[f"blocks.{min(j, last)}.mlp.down.weight"]
                )
        h = torch.randn(2, 16, 32)
        assert torch.isfinite(rebuilt(h)).all()


def test_recovery_optimizer_has_fresh_moments_and_a_scaled_learning_rate():
    cfg = InnerOptimConfig(lr=2e-3, warmup_steps=0)
    stage = build_stage(ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=16), 2, 1)
    opt, _ = make_recovery_optimizer(stage.parameters(), cfg)
    assert RECOVERY_LR_SCALE == 1.1
    assert all(group["lr"] == pytest.approx(2e-3 * 1.1) for group in opt.param_groups)
    assert not opt.state
