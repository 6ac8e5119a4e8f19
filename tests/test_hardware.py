"""Model presets, stage sizing, the device a peer computes on, and bf16 precision.

No GPU is needed: every device-specific line (``.to(device)``, autocast) runs here with device cpu, the
same calls a CUDA peer makes; bf16 autocast runs on the CPU too.
"""

import subprocess
import tomllib
from pathlib import Path

import pytest
import torch

from swarm.config import SwarmConfig, config_from_dict, derive_config
from swarm.config_toml import load_config, save_config
from swarm.errors import ConfigError
from swarm.hardware import CPU, compute_precision, resolve_device
from swarm.model.sizing import (
    GIB,
    OUTER_BYTES_PER_PARAMETER,
    STASH_BYTES_PER_PARAMETER,
    TRAINING_BYTES_PER_PARAMETER,
    StageDoesNotFit,
    StageFootprint,
    check_fits,
    model_parameters,
    stage_parameters,
)
from swarm.model.stages import build_stage
from swarm.model.transformer import PRESETS, ModelConfig, Transformer
from swarm.pipeline.server import CacheEntry, StageServer
from swarm.sim.centralized import evaluate, train_centralized
from swarmtest.configs import DEFAULT_SWARM_HASH, tiny_config
from swarmtest.processes import swarmloco


def test_the_default_config_keeps_its_swarm_id_and_is_the_tiny_preset() -> None:
    cfg = SwarmConfig()
    assert cfg.hash() == DEFAULT_SWARM_HASH
    assert cfg.model.preset == "tiny" and cfg.train.precision == "fp32"
    assert derive_config(cfg, {"train.precision": "bf16"}).hash() != DEFAULT_SWARM_HASH


def test_a_preset_named_in_a_config_file_fills_the_shape_it_leaves_out(tmp_path: Path) -> None:
    path = tmp_path / "swarm.toml"
    path.write_text('[model]\npreset = "125m"\n[stages]\nnum_stages = 2\n')
    model = load_config(path).model
    assert (model.d_model, model.n_layers, model.n_heads, model.max_seq_len) == (768, 12, 12, 1024)
    save_config(load_config(path), tmp_path / "again.toml")
    assert tomllib.loads((tmp_path / "again.toml").read_text())["model"]["preset"] == "125m"
    assert load_config(tmp_path / "again.toml") == load_config(path)


def test_a_preset_on_the_command_line_brings_its_shape_and_a_changed_shape_is_custom() -> None:
    cfg = derive_config(SwarmConfig(), {"model.preset": "20m", "model.n_layers": 4})
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.preset) == (384, 4, "custom")
    assert derive_config(cfg, {"model.preset": "tiny"}).model == ModelConfig()
    assert (
        config_from_dict({"model": {"d_model": 768, "n_layers": 12, "n_heads": 12, "max_seq_len": 1024}}).model.preset
        == "125m"
    )
    with pytest.raises(ConfigError, match="model.preset"):
        derive_config(SwarmConfig(), {"model.preset": "7b"})


@pytest.mark.parametrize("preset", ["tiny", "20m", "125m"])
def test_parameter_counts_are_those_of_the_built_stages(preset: str) -> None:
    model = ModelConfig(**PRESETS[preset])
    built = Transformer(model)
    assert model_parameters(model) == sum(p.numel() for p in built.parameters())
    for stage in range(3):
        assert stage_parameters(model, 2, stage) == sum(p.numel() for p in build_stage(model, 2, stage).parameters())


def test_subspace_stages_are_counted_too() -> None:
    model = ModelConfig(d_model=64, n_layers=3, n_heads=4, subspace_rank=8)
    for stage in range(4):
        assert stage_parameters(model, 3, stage) == sum(p.numel() for p in build_stage(model, 3, stage).parameters())


def test_the_footprint_grows_with_the_outer_state_and_shrinks_with_bf16_activations() -> None:
    cfg = derive_config(SwarmConfig(), {"model.preset": "125m", "stages.num_stages": 2})
    diloco = StageFootprint.of(derive_config(cfg, outer="diloco"), 1)
    ddp = StageFootprint.of(derive_config(cfg, outer="ddp"), 1)
    bf16 = StageFootprint.of(derive_config(cfg, {"train.precision": "bf16"}, outer="diloco"), 1)
    assert diloco.training_bytes == (TRAINING_BYTES_PER_PARAMETER + STASH_BYTES_PER_PARAMETER) * diloco.parameters
    edge = StageFootprint.of(derive_config(cfg, outer="diloco"), 0)  # a trainer keeps no stash
    assert edge.training_bytes == TRAINING_BYTES_PER_PARAMETER * edge.parameters
    assert diloco.outer_bytes == OUTER_BYTES_PER_PARAMETER * diloco.parameters
    assert ddp.outer_bytes == 0 and bf16.activation_bytes < diloco.activation_bytes
    assert "stage 1: 42.5M parameters" in diloco.describe()


def test_a_stage_that_does_not_fit_is_refused_saying_what_it_needs_and_has() -> None:
    footprint = StageFootprint.of(derive_config(SwarmConfig(), {"model.preset": "1b", "stages.num_stages": 2}), 1)
    with pytest.raises(StageDoesNotFit) as refused:
        check_fits(footprint, available=2 * GIB, device="cuda:0 (a small GPU)")
    assert f"{footprint.total_bytes / GIB:.2f} GiB" in str(refused.value)
    assert "cuda:0 (a small GPU) has 2.00 GiB free" in str(refused.value)
    check_fits(footprint, available=footprint.total_bytes, device="cpu")


def test_devices_resolve_or_are_refused_naming_the_flag() -> None:
    assert resolve_device("cpu") == CPU
    expected = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    assert resolve_device("auto").type == expected
    with pytest.raises(ConfigError, match="--device.*'gpu'"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device.*no CUDA GPU"):
            resolve_device("cuda:1")


def test_bf16_trains_with_fp32_master_weights_and_sends_fp32_on_the_wire() -> None:
    cfg = tiny_config(stages=1, steps=30, inner={"lr": 1e-2}, train={"precision": "bf16"})
    torch.manual_seed(0)
    data = torch.randint(0, 64, (256, cfg.train.seq_len + 1))
    batches = iter([(w[:, :-1], w[:, 1:]) for w in data.split(cfg.train.microbatch_size)] * 10)
    val = [(data[:8, :-1], data[:8, 1:])]
    untrained = evaluate(Transformer(cfg.model), val, precision="bf16")
    model = train_centralized(cfg, batches, val, steps=30, log_every=30, device=CPU)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert evaluate(model, val, precision="bf16") < untrained - 0.5

    server = StageServer(cfg, 1, device=CPU)
    x = torch.randn(2, cfg.train.seq_len, cfg.model.d_model)
    y = server._compute_forward(x)
    entry = CacheEntry(x=x, tokens=None, forward_s=0.0, weights=0)
    grad_x = server._compute_backward(entry, torch.randn_like(y), "trainer")
    assert y.dtype == grad_x.dtype == torch.float32
    with compute_precision(CPU, "bf16"):  # the blocks did run in bf16
        assert server.module.blocks[0].attn.qkv(x).dtype == torch.bfloat16
    server.shutdown()


def test_commands_refuse_a_device_or_a_model_this_machine_lacks_before_allocating(
    tmp_path: Path, child_processes: list[subprocess.Popen]
) -> None:
    huge = derive_config(SwarmConfig(), {"model.d_model": 8192, "model.n_layers": 96, "model.n_heads": 64})
    save_config(huge, tmp_path / "huge.toml")  # ≈ 77B parameters: >1 TiB to train, far past this machine
    no_gpu, too_big, stage_too_big = swarmloco(
        ["train-local", "--device", "cuda:7", "--steps", "1", "--out", str(tmp_path / "a")],
        ["train-local", "--config", str(tmp_path / "huge.toml"), "--device", "cpu", "--out", str(tmp_path / "b")],
        ["run", "--role", "stage", "--stage", "1", "--config", str(tmp_path / "huge.toml"), "--device", "cpu"],
        children=child_processes,
        timeout=120,
    )
    if not torch.cuda.is_available() or torch.cuda.device_count() < 8:
        assert no_gpu.returncode == 2 and "--device" in no_gpu.stderr and "cuda:7" in no_gpu.stderr
    for result in (too_big, stage_too_big):
        assert result.returncode == 2, result.stderr
        assert "needs ≈" in result.stderr + result.stdout and "GiB free" in result.stderr
        assert "Traceback" not in result.stderr
