"""The swarm config tree: validation errors name the field path, Literal choices, TOML round trip, stable hash, one derivation."""

import dataclasses
import pickle
from pathlib import Path
from typing import Annotated, Literal

import pytest
import torch
import typer
from typer.testing import CliRunner

from compress.codecs import CODEC_NAMES, get_codec
from compress.config import CodecConfig
from compress.errors import ConfigError as CompressConfigError
from optim.config import OUTER_METHODS, InnerOptimConfig, OuterMethod, OuterOptimConfig
from peer.commands.one_process import SIMULATE_CONFIG_OPTIONS
from peer.config_options import ConfigOverrides, config_options
from swarm.config import (
    OuterChoice,
    SwarmConfig,
    config_from_dict,
    derive_config,
    follow_run,
    from_dict,
    parse_overrides,
)
from swarm.config_toml import class_docs, dumps_config, load_config, save_config, sets_field
from swarm.errors import ConfigError
from swarm.model.transformer import PRESET_INNER, PRESETS, ModelConfig
from swarmtest.configs import DEFAULT_SWARM_HASH


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = SwarmConfig(name="lab-1", model=ModelConfig(d_model=96, n_heads=3, subspace_rank=12))
    save_config(cfg, tmp_path / "swarm.toml")
    loaded = load_config(tmp_path / "swarm.toml")
    assert loaded == cfg and loaded.hash() == cfg.hash()
    assert "[model]" in dumps_config(cfg)


def test_hash_is_stable_and_sensitive_to_every_section() -> None:
    base = SwarmConfig()
    assert base.hash() == SwarmConfig().hash() and len(base.hash()) == 16
    changed = [
        dataclasses.replace(base, name="other"),
        dataclasses.replace(base, model=dataclasses.replace(base.model, n_layers=6)),
        dataclasses.replace(base, inner=dataclasses.replace(base.inner, lr=1e-3)),
        dataclasses.replace(base, outer=dataclasses.replace(base.outer, inner_steps=20)),
        dataclasses.replace(base, codecs=dataclasses.replace(base.codecs, activations="fp16")),
    ]
    assert len({c.hash() for c in changed} | {base.hash()}) == len(changed) + 1


@pytest.mark.parametrize(
    "data,field",
    [
        ({"model": {"d_model": -1}}, "model.d_model"),
        ({"model": {"n_heads": 5}}, "model.n_heads"),
        ({"model": {"d_modl": 3}}, "model.d_modl"),
        ({"model": {"d_model": "wide"}}, "model.d_model"),
        ({"model": {"n_layers": True}}, "model.n_layers"),
        ({"stages": {"num_stages": 9}}, "stages.num_stages"),
        ({"train": {"seq_len": 4096}}, "train.seq_len"),
        ({"train": {"inner_batch": 18}}, "train.inner_batch"),  # not a multiple of the microbatch
        ({"codecs": {"activations": "gzip"}}, "codecs.activations"),
        ({"codecs": {"topk": 0}}, "codecs.topk"),
        ({"codecs": {"activations": "subspace"}}, "codecs.activations"),
        ({"inner": {"lr": 0}}, "inner.lr"),
        ({"outer": {"method": "adam"}}, "outer.method"),
        ({"outer": {"method": "diloco"}}, "codecs.pseudo_gradients"),
        ({"timeouts": {"record_ttl_s": 1.0}}, "timeouts.record_ttl_s"),
        ({"paths": {"skip_ratio": 1.5}}, "paths.skip_ratio"),
        ({"name": "has space"}, "name"),
        ({"model": 3}, "model"),
    ],
)
def test_invalid_values_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert err.value.field == field and f"'{field}'" in str(err.value)


def test_integers_are_accepted_for_float_fields() -> None:
    assert config_from_dict({"outer": {"method": "sparseloco", "diloco_lr": 1}}).outer.diloco_lr == 1.0


def test_unreadable_files_give_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("[model\nd_model = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")


def test_config_error_carries_the_field_as_data() -> None:
    err = CompressConfigError("topk", "must be positive").within("sparseloco").within("outer")
    assert ConfigError is CompressConfigError  # one error type, defined in the bottom layer
    assert (err.field, err.message) == ("outer.sparseloco.topk", "must be positive")
    assert str(err) == "config field 'outer.sparseloco.topk': must be positive"
    assert pickle.loads(pickle.dumps(err)).field == err.field  # errors cross process boundaries intact


@dataclasses.dataclass(kw_only=True)
class _Leaf:
    topk: int = 1

    def __post_init__(self) -> None:
        if self.topk < 1:
            raise ConfigError("topk", f"must be positive, got {self.topk}")


@dataclasses.dataclass(kw_only=True)
class _Section:
    sparseloco: _Leaf = dataclasses.field(default_factory=_Leaf)
    mode: Literal["a", "b"] = "a"


@dataclasses.dataclass(kw_only=True)
class _Root:
    outer: _Section = dataclasses.field(default_factory=_Section)


@pytest.mark.parametrize(
    "data,field",
    [
        (
            {"outer": {"sparseloco": {"topk": 0}}},
            "outer.sparseloco.topk",
        ),  # raised by the leaf, prefixed by each section
        ({"outer": {"sparseloco": {"topk": "many"}}}, "outer.sparseloco.topk"),
        ({"outer": {"sparseloco": {"top": 1}}}, "outer.sparseloco.top"),
        ({"outer": {"mode": "c"}}, "outer.mode"),
        ({"outer": {"sparseloco": 3}}, "outer.sparseloco"),
    ],
)
def test_nested_errors_name_the_full_field_path(data: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(_Root, data)
    assert err.value.field == field and str(err.value).startswith(f"config field '{field}': ")


@pytest.mark.parametrize(
    "data,field",
    [
        (
            {"inner": {"warmup_steps": -1}},
            "inner.warmup_steps",
        ),  # once one message for three fields, misread by a regex
        ({"inner": {"weight_decay": -0.1}}, "inner.weight_decay"),
        ({"inner": {"grad_clip": -1.0}}, "inner.grad_clip"),
        ({"inner": {"beta2": 1.0}}, "inner.beta2"),
        (
            {"outer": {"method": "diloco", "diloco_momentum": 1.0}, "codecs": {"pseudo_gradients": "fp32"}},
            "outer.diloco_momentum",
        ),
        ({"codecs": {"error_decay": 2.0}}, "codecs.error_decay"),
        ({"codecs": {"chunk_size": 1024}}, "codecs.chunk_size"),
    ],
)
def test_component_errors_outside_swarm_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert err.value.field == field


@pytest.mark.parametrize(
    "data,field,choices",
    [
        ({"outer": {"method": "adam"}}, "outer.method", OUTER_METHODS),
        ({"codecs": {"activations": "gzip"}}, "codecs.activations", (*CODEC_NAMES, "adaptive")),
        ({"codecs": {"gradients": 8}}, "codecs.gradients", (*CODEC_NAMES, "adaptive")),
        ({"codecs": {"pseudo_gradients": "int8"}}, "codecs.pseudo_gradients", ("fp32", "fp16", "bf16", "sparseloco")),
    ],
)
def test_an_unknown_choice_lists_the_choices(data: dict, field: str, choices: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert err.value.field == field
    assert err.value.message.endswith("choose from " + ", ".join(choices))


def test_choices_are_checked_when_built_in_python_too() -> None:
    with pytest.raises(ConfigError, match="choose from none, diloco, sparseloco") as err:
        OuterOptimConfig(method="adam")  # type: ignore[arg-type]  # a wrong value, on purpose
    assert err.value.field == "method"
    with pytest.raises(ConfigError) as err:
        CodecConfig(activations="subspace+int2")  # type: ignore[arg-type]  # a wrong value, on purpose
    assert err.value.field == "activations"


def test_every_registered_codec_is_a_config_choice() -> None:
    for name in CODEC_NAMES:
        CodecConfig(activations=name, gradients=name)
        if name.startswith("subspace"):
            get_codec(name, basis=torch.eye(4)[:, :2], table=torch.zeros(8, 4))
        else:
            assert get_codec(name).name == name


def test_derive_config_applies_the_rules() -> None:
    base = SwarmConfig()
    ddp = derive_config(base, {"codecs.activations": "subspace+int8"}, outer="ddp")
    assert ddp.outer.method == "none" and ddp.codecs.gradients == "subspace+int8"
    assert ddp.model.subspace_rank == base.model.d_model // 8
    diloco = derive_config(base, {"outer.inner_steps": 7}, outer="diloco")
    assert (diloco.outer.method, diloco.outer.inner_steps, diloco.codecs.pseudo_gradients) == ("diloco", 7, "fp32")
    sparse = derive_config(diloco, {"codecs.pseudo_gradients": "fp16"}, outer="sparseloco")
    assert sparse.codecs.pseudo_gradients == "sparseloco"
    assert derive_config(base, {"model.subspace_rank": 32, "codecs.activations": "subspace"}).model.subspace_rank == 32
    assert derive_config(base) == base
    with pytest.raises(ConfigError) as err:
        derive_config(base, {"paths.skip_ratio": 1.5})
    assert err.value.field == "paths.skip_ratio"
    for path in ("codecz.topk", "codecs.nope", "codecs"):
        with pytest.raises(ConfigError) as err:
            derive_config(base, {path: 1})
        assert err.value.field.startswith(path.split(".")[0])


def test_parse_overrides_types_each_value_and_refuses_a_pair_without_a_path() -> None:
    overrides = parse_overrides(["train.microbatch_size=4", "inner.lr=0.001", "codecs.activations=fp16"])
    assert overrides == {"train.microbatch_size": 4, "inner.lr": 0.001, "codecs.activations": "fp16"}
    assert derive_config(SwarmConfig(), overrides).train.microbatch_size == 4
    for bad in ("train.microbatch_size", "=4"):
        with pytest.raises(ValueError, match="expected PATH=VALUE"):
            parse_overrides([bad])


def _cli_config(base: SwarmConfig, args: list[str]) -> SwarmConfig:
    """The config ``swarmloco simulate`` derives from these flags (its option table, parsed by typer)."""
    app, derived = typer.Typer(), []

    @app.command()
    @config_options(*SIMULATE_CONFIG_OPTIONS)
    def simulate(
        outer: Annotated[OuterChoice, typer.Option()] = "sparseloco", overrides: ConfigOverrides = None
    ) -> None:
        derived.append(derive_config(base, overrides, outer=outer))

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return derived[0]


def test_simulate_keeps_its_flags() -> None:
    cfg = _cli_config(
        SwarmConfig(),
        [
            "--outer",
            "diloco",
            "-H",
            "9",
            "--act-codec",
            "fp16",
            "--grad-codec",
            "int4",
            "--pg-codec",
            "bf16",
            "--skip",
            "0.25",
            "--swaps",
            "1",
            "--subspace-rank",
            "8",
        ],
    )
    assert (
        cfg.outer.method,
        cfg.outer.inner_steps,
        cfg.paths.skip_ratio,
        cfg.paths.max_swaps,
        cfg.model.subspace_rank,
    ) == ("diloco", 9, 0.25, 1, 8)
    assert (cfg.codecs.activations, cfg.codecs.gradients, cfg.codecs.pseudo_gradients) == ("fp16", "int4", "bf16")
    assert _cli_config(SwarmConfig(), ["--inner-steps", "4"]).outer.inner_steps == 4
    assert _cli_config(SwarmConfig(), []) == derive_config(
        SwarmConfig(), {"codecs.pseudo_gradients": "fp32"}, outer="sparseloco"
    )


@pytest.mark.parametrize("codec", ["int8", "fp16", "subspace"])
@pytest.mark.parametrize("outer", ["diloco", "sparseloco", "noloco"])
def test_every_caller_derives_the_same_config(codec: str, outer: OuterMethod) -> None:
    from peer.launch import LocalSwarm, local_config
    from scripts import bench_e2e
    from scripts.bench_convergence import Row, row_config
    from swarmtest.bench import bench_config

    base, h = SwarmConfig(), 10
    cli = _cli_config(base, ["--outer", outer, "-H", str(h), "--act-codec", codec])
    assert cli == row_config(base, Row(name="run", outer=outer), codec=codec, h=h, seed=0)
    assert cli.model.subspace_rank == (base.model.d_model // 8 if codec == "subspace" else 0)
    layout = LocalSwarm(peers=5, stages=3, trainers=2)
    local = _cli_config(local_config(base, layout), ["--outer", outer, "-H", str(h), "--act-codec", codec])
    assert local == bench_e2e.run_config(
        base, bench_e2e.Run(bandwidth_mbit=None, act_codec=codec, outer=outer), layout, h
    )
    assert local == bench_config(local_config(base, layout), outer, h, codec)
    ddp = _cli_config(base, ["--outer", "ddp", "-H", str(h), "--act-codec", codec])
    assert ddp.outer.method == "none" and ddp == row_config(
        base, Row(name="run", outer="ddp"), codec=codec, h=h, seed=0
    )


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_preset_brings_its_inner_optimizer_and_a_field_the_config_sets_wins(preset: str) -> None:
    brought = PRESET_INNER[preset]
    from_file = config_from_dict({"model": {"preset": preset}})
    assert {k: getattr(from_file.inner, k) for k in brought} == brought
    from_cli = derive_config(SwarmConfig(), {"model.preset": preset})
    assert from_cli == from_file
    own = config_from_dict({"model": {"preset": preset}, "inner": {"lr": 5e-5}})
    assert (own.inner.lr, own.inner.warmup_steps) == (5e-5, brought["warmup_steps"])
    cli_own = derive_config(SwarmConfig(), {"model.preset": preset, "inner.warmup_steps": 7})
    assert (cli_own.inner.lr, cli_own.inner.warmup_steps) == (brought["lr"], 7)
    # a new preset replaces the old one's optimizer as it replaces its shape; a file written from it loads back alike
    assert derive_config(from_cli, {"model.preset": "tiny"}) == SwarmConfig()
    assert config_from_dict(from_cli.to_dict()) == from_cli


def test_the_tiny_preset_s_optimizer_is_the_default_so_swarms_keep_their_ids() -> None:
    assert {k: getattr(InnerOptimConfig(), k) for k in PRESET_INNER["tiny"]} == PRESET_INNER["tiny"]
    assert config_from_dict({"model": {"preset": "tiny"}}).hash() == SwarmConfig().hash() == DEFAULT_SWARM_HASH
    assert config_from_dict({"model": {"d_model": 384, "n_layers": 12, "n_heads": 6, "max_seq_len": 1024}}).inner == (
        InnerOptimConfig()
    ), "only a named preset brings an optimizer: a shape that matches one keeps the defaults (and its swarm id)"
    assert (
        config_from_dict({"model": {"preset": "20m"}}).hash()
        != derive_config(SwarmConfig(), {"model.preset": "20m", "inner.lr": 3e-3, "inner.warmup_steps": 30}).hash()
    )


def test_config_show_cites_each_preset_s_lr_and_warm_up() -> None:
    _, docs = class_docs(InnerOptimConfig)
    for preset, fields in PRESET_INNER.items():
        assert f"{preset} {fields['lr']:.0e}".replace("e-0", "e-") in docs["lr"], (preset, docs["lr"])
        assert f"{preset} {fields['warmup_steps']}" in docs["warmup_steps"], (preset, docs["warmup_steps"])
    shown = dumps_config(derive_config(SwarmConfig(), {"model.preset": "125m"}), commented=True)
    assert "lr = 0.0006" in shown and "GPT-3 Small" in shown and "Pythia" in shown and "TinyLlama" in shown


def test_the_schedule_follows_the_run_unless_the_config_sets_it(tmp_path: Path) -> None:
    from peer.launch import LocalSwarm, local_config

    assert follow_run(SwarmConfig(), 250, schedule_set=False).inner.total_steps == 250
    assert follow_run(SwarmConfig(), 250, schedule_set=True) == SwarmConfig()
    layout = LocalSwarm(peers=3, stages=2, steps=40)
    assert local_config(SwarmConfig(), layout).inner.total_steps == 40
    assert local_config(SwarmConfig(), layout, schedule_set=True).inner.total_steps == 1000
    sparse, pinned, printed = tmp_path / "sparse.toml", tmp_path / "pinned.toml", tmp_path / "printed.toml"
    sparse.write_text('[model]\npreset = "20m"\n[inner]\nlr = 1e-3\n')
    pinned.write_text("[inner]\ntotal_steps = 1000\n")
    assert not sets_field(None, "inner.total_steps") and not sets_field(sparse, "inner.total_steps")
    assert sets_field(pinned, "inner.total_steps") and sets_field(sparse, "inner.lr")
    # what `config show` prints leaves the schedule to the run while it holds the default, and loads back the same
    save_config(SwarmConfig(), printed)
    assert "# total_steps = 1000" in printed.read_text() and not sets_field(printed, "inner.total_steps")
    assert load_config(printed) == SwarmConfig()
    longer = follow_run(SwarmConfig(), 5000, schedule_set=False)
    save_config(longer, printed)
    assert sets_field(printed, "inner.total_steps") and load_config(printed) == longer
