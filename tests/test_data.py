"""Byte tokenizer, corpus loading, the train/validation split and the batch sampler."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.data import DataError, decode, default_corpus_paths, encode, is_validation_file, load_corpus


@given(st.text(max_size=200))
@settings(max_examples=100, deadline=None)
def test_tokenizer_round_trips_any_text(text: str) -> None:
    tokens = encode(text)
    assert tokens.dtype == torch.int64 and (tokens < 256).all() and (tokens >= 0).all()
    assert decode(tokens) == text


def write_corpus(root: Path, files: int = 60) -> None:
    for i in range(files):
        (root / f"f{i}.txt").write_text(f"file {i} " * 50)


def test_split_is_by_file_and_deterministic(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    a, b = load_corpus([tmp_path]), load_corpus([str(tmp_path)])
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    val_names = {f"f{i}.txt" for i in range(60) if is_validation_file(f"f{i}.txt")}
    val_text = decode(a.val)
    assert val_names and all(f"file {n[1:-4]} " in val_text for n in val_names)
    assert not any(f"file {i} " in decode(a.train) for i in range(60) if f"f{i}.txt" in val_names)


def test_split_does_not_depend_on_where_the_corpus_lives(tmp_path: Path) -> None:
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        write_corpus(tmp_path / name)
    assert torch.equal(load_corpus([tmp_path / "one"]).val, load_corpus([tmp_path / "two"]).val)


def test_sampler_streams_are_seeded_and_distinct(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    corpus = load_corpus([tmp_path])
    take = lambda seed: next(corpus.sample_batches("train", batch_size=4, seq_len=16, seed=seed))
    (x1, y1), (x1b, _), (x2, _) = take(1), take(1), take(2)
    assert x1.shape == y1.shape == (4, 16)
    assert torch.equal(x1, x1b) and not torch.equal(x1, x2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    val = corpus.val_batches(batch_size=2, seq_len=16, num_batches=3)
    assert len(val) == 3 and all(
        torch.equal(a[0], b[0]) for a, b in zip(val, corpus.val_batches(batch_size=2, seq_len=16, num_batches=3))
    )


def test_jsonl_globs_and_single_files(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": f"record {i} " * 20}) for i in range(30)))
    (tmp_path / "b.md").write_text("# notes\n" * 200)
    corpus = load_corpus([str(tmp_path / "*.jsonl"), tmp_path / "b.md"])
    text = decode(corpus.train) + decode(corpus.val)
    assert "record 7" in text and "# notes" in text and '"text"' not in text


def file_with(name: str, text: str):
    def make(root: Path) -> Path:
        (root / name).write_text(text)
        return root / name

    return make


def empty_dir(root: Path) -> Path:
    (root / "empty").mkdir()
    return root / "empty"


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda p: p / "missing", "missing"),
        (empty_dir, "no text files"),
        (file_with("e.txt", ""), "empty"),
        (file_with("bad.jsonl", "{not json}\n"), "bad.jsonl:1"),
        (file_with("short.txt", "hi"), "fewer than one window"),
    ],
)
def test_unusable_corpus_gives_a_clear_error_naming_the_path(tmp_path: Path, make, message: str) -> None:
    with pytest.raises(DataError, match=message):
        corpus = load_corpus([make(tmp_path)])
        next(corpus.sample_batches("train", batch_size=1, seq_len=128, seed=0))


def test_default_corpus_is_the_stdlib_source() -> None:
    paths = default_corpus_paths()
    assert len(paths) > 100 and all(p.suffix == ".py" for p in paths)
    assert not any("site-packages" in p.parts for p in paths)
