"""The swarm config tree: validation errors name the field, TOML round trip, stable hash."""

import dataclasses
from pathlib import Path

import pytest

from swarm.config import SwarmConfig, config_from_dict, dumps_config, load_config, save_config
from swarm.errors import ConfigError
from swarm.model.transformer import ModelConfig


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


@pytest.mark.parametrize("data,field", [
    ({"model": {"d_model": -1}}, "model.d_model"),
    ({"model": {"n_heads": 5}}, "model.n_heads"),
    ({"model": {"d_modl": 3}}, "model.d_modl"),
    ({"model": {"d_model": "wide"}}, "model.d_model"),
    ({"model": {"n_layers": True}}, "model.n_layers"),
    ({"stages": {"num_stages": 9}}, "stages.num_stages"),
    ({"train": {"seq_len": 4096}}, "train.seq_len"),
    ({"train": {"inner_batch": 20}}, "train.inner_batch"),
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
])
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
