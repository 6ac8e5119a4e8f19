"""The BPE tokenizer: trained locally, round-trips text, named in the swarm config, and refused when it does not match."""

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from peer.cli import app
from peer.data import decode, encode, load_corpus
from peer.tokenizer import (
    BYTES,
    TokenizerError,
    check_tokenizer,
    file_sha256,
    load_tokenizer,
    train_bpe,
    with_tokenizer,
)
from swarm.config import DataConfig, SwarmConfig
from swarm.config_toml import dumps_config, load_config
from swarm.errors import ConfigError
from swarmtest.configs import DEFAULT_SWARM_HASH

VOCAB = 400


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (root / f"f{i}.py").write_text(f"def function_{i}(value):\n    return value * {i} + len('text {i}')\n" * 30)
    return root


@pytest.fixture(scope="module")
def bpe_file(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tok.json"
    result = CliRunner().invoke(
        app, ["tokenizer", "train", "--data", str(corpus_dir), "--vocab-size", str(VOCAB), "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "read 40 documents" in result.output and f"sha256 {file_sha256(out)}" in result.output
    return out


@given(st.text(max_size=200))
@settings(max_examples=100, deadline=None)
def test_bpe_round_trips_any_text(bpe_file: Path, text: str) -> None:
    tok = load_tokenizer(bpe_file)
    tokens = encode(text, tok)
    assert tokens.dtype == torch.int64 and ((tokens >= 0) & (tokens < tok.vocab_size)).all()
    assert decode(tokens, tok) == text


def test_bpe_learns_merges_and_the_corpus_holds_ids_above_255(bpe_file: Path, corpus_dir: Path) -> None:
    tok = load_tokenizer(bpe_file)
    assert tok.kind == "bpe" and 256 < tok.vocab_size <= VOCAB
    assert len(encode("def function_1(value):", tok)) < len("def function_1(value):") / 2  # merges were learned
    corpus = load_corpus([corpus_dir], tokenizer=tok)
    assert corpus.train.dtype == torch.int16 and int(corpus.train.max()) >= 256
    x, y = next(corpus.sample_batches("train", batch_size=2, seq_len=16, seed=0))
    assert x.dtype == torch.int64 and int(x.max()) < tok.vocab_size
    assert "return value" in decode(corpus.train, tok)


def test_the_default_config_hash_leaves_the_data_section_out(tmp_path: Path) -> None:
    cfg = SwarmConfig()
    before = DEFAULT_SWARM_HASH  # the id of every public swarm on the default config, from before [data] existed
    assert cfg.hash() == before
    old_toml = tmp_path / "old.toml"
    old_toml.write_text(dumps_config(cfg).split("[data]")[0])  # a swarm.toml written before the section existed
    assert load_config(old_toml).hash() == before
    sharded = dataclasses.replace(cfg, data=DataConfig(shards=2))
    bpe = dataclasses.replace(cfg, data=DataConfig(tokenizer="bpe", tokenizer_sha256="a" * 64))
    assert len({cfg.hash(), sharded.hash(), bpe.hash()}) == 3, "the tokenizer and the shards are part of the swarm"


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"tokenizer": "bpe"}, "64 lowercase hex"),
        ({"tokenizer": "bpe", "tokenizer_sha256": "A" * 64}, "64 lowercase hex"),
        ({"tokenizer_sha256": "a" * 64}, "byte tokenizer has no file"),
        ({"shards": 0}, "shards"),
    ],
)
def test_bad_data_sections_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataConfig(**fields)


def test_swarm_create_names_the_tokenizer_and_sizes_the_model(bpe_file: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["swarm", "create", "--name", "demo", "--out", str(tmp_path), "--tokenizer", str(bpe_file)]
        + ["--data-shards", "3"],
    )
    assert result.exit_code == 0, result.output
    cfg, tok = load_config(tmp_path / "swarm.toml"), load_tokenizer(bpe_file)
    assert (cfg.data.tokenizer, cfg.data.tokenizer_sha256, cfg.data.shards) == ("bpe", tok.sha256, 3)
    assert cfg.model.vocab_size == tok.vocab_size
    check_tokenizer(cfg, tok, bpe_file)  # the file it was made with passes


def test_a_tokenizer_the_config_does_not_name_is_refused(bpe_file: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(bpe_file)
    cfg = with_tokenizer(SwarmConfig(), tok)
    other_file = tmp_path / "other.json"
    shutil.copy(bpe_file, other_file)
    with other_file.open("a") as f:
        f.write("\n")  # the same tokenizer, another file: another sha256
    cases = [
        (cfg, load_tokenizer(other_file), "sha256"),
        (cfg, BYTES, "pass its file with --tokenizer"),
        (SwarmConfig(), tok, "run without --tokenizer"),
        (dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=1000)), tok, "model.vocab_size"),
    ]
    for config, tokenizer, message in cases:
        with pytest.raises(TokenizerError, match=message):
            check_tokenizer(config, tokenizer, other_file)


def test_commands_refuse_a_mismatched_tokenizer_in_one_line(bpe_file: Path, corpus_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "swarm.toml"
    config.write_text(dumps_config(with_tokenizer(SwarmConfig(), load_tokenizer(bpe_file))))
    other = tmp_path / "other.json"
    train_bpe([(corpus_dir / "f1.py").read_text()], vocab_size=300, out=other)
    runner = CliRunner()
    for args, message in [
        (["train-local", "--config", str(config), "--tokenizer", str(other)], "sha256"),
        (["train-local", "--config", str(config)], "pass its file with --tokenizer"),
        (["simulate", "--config", str(config), "--tokenizer", str(other)], "sha256"),
    ]:
        result = runner.invoke(
            app, [*args, "--data", str(corpus_dir), "--steps" if args[0] == "train-local" else "--tokens", "1"]
        )
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output


def test_unusable_tokenizer_files_are_refused(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not a tokenizer")
    with pytest.raises(TokenizerError, match="is not a tokenizer file"):
        load_tokenizer(garbage)
    with pytest.raises(TokenizerError, match="cannot read"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(TokenizerError, match="above 256"):
        train_bpe(["text"], vocab_size=100, out=tmp_path / "small.json")
    result = CliRunner().invoke(
        app, ["tokenizer", "train", "--data", str(tmp_path / "nothing"), "-o", str(tmp_path / "t.json")]
    )
    assert result.exit_code == 2 and "nothing" in result.output


def test_without_tokenizers_a_bpe_names_the_extra_to_install(
    bpe_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers raises ImportError
    for attempt in (lambda: load_tokenizer(bpe_file), lambda: train_bpe(["x"], vocab_size=300, out=tmp_path / "t")):
        with pytest.raises(TokenizerError, match=r"swarmloco\[data\]"):
            attempt()
