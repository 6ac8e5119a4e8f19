"""Byte tokenizer, corpus loading, the train/validation split and the batch sampler."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.data import (
    VAL_SEQUENCES,
    DataError,
    Shard,
    check_text,
    decode,
    default_corpus_paths,
    encode,
    is_validation_file,
    iter_documents,
    load_corpus,
    resolve_paths,
)


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
    val = corpus.val_batches(batch_size=2, seq_len=16, num_sequences=6)
    assert len(val) == 3 and all(
        torch.equal(a[0], b[0]) for a, b in zip(val, corpus.val_batches(batch_size=2, seq_len=16, num_sequences=6))
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


def random_bytes(size: int) -> bytes:
    return (
        torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(size)).to(torch.uint8).numpy().tobytes()
    )


@pytest.mark.parametrize(
    "name,content",
    [
        ("random.bin", random_bytes(200_000)),  # a file given by name is read whatever its suffix
        ("random.txt", random_bytes(200_000)),
        ("small.txt", random_bytes(3000)),
        ("no-nul.md", bytes(b for b in random_bytes(100_000) if b)),  # not caught by NUL bytes alone
        ("utf16.txt", ("naïve café 日本語\n" * 500).encode("utf-16")),
        ("records.jsonl", random_bytes(100_000)),
    ],
)
def test_binary_files_are_refused_naming_the_file(tmp_path: Path, name: str, content: bytes) -> None:
    (tmp_path / name).write_bytes(content)
    write_corpus(tmp_path)  # good files beside it do not hide it
    for spec in (tmp_path / name, tmp_path):
        if spec == tmp_path and name.endswith(".bin"):
            continue  # a folder is searched for text suffixes only: random.bin is not read
        message = rf"{re.escape(str(tmp_path / name))} does not look like text: \d+% of its .* not valid UTF-8"
        with pytest.raises(DataError, match=message):
            load_corpus([spec])


def test_text_in_any_language_and_stray_invalid_bytes_are_accepted(tmp_path: Path) -> None:
    (tmp_path / "intl.txt").write_text("naïve café 日本語 Ελληνικά — ✓\tdone\x0c\n" * 2000, encoding="utf-8")
    # a character cut by the 64 KiB prefix's end, and a stray latin-1 byte, are not binary
    (tmp_path / "cut.md").write_bytes(b"a" * (64 * 1024 - 1) + "日本語".encode() * 100 + b"caf\xe9\n" * 10)
    corpus = load_corpus([tmp_path])
    assert "日本語 Ελληνικά" in all_text(corpus) and "caf\ufffd" in all_text(corpus)


def test_real_text_corpora_look_like_text() -> None:
    vim_docs = Path("/usr/share/vim/vim90/doc")
    paths = default_corpus_paths() + (sorted(vim_docs.glob("*.txt")) if vim_docs.is_dir() else [])
    for path in paths:
        check_text(path, path.read_bytes())


def write_parquet(path: Path, texts: list[str], *, rows_per_group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path, row_group_size=rows_per_group)


def write_saved_dataset(folder: Path, texts: list[str], *, files: int = 2) -> None:
    """What ``datasets.Dataset.save_to_disk`` writes: arrow IPC stream files, dataset_info.json and state.json."""
    import pyarrow as pa

    folder.mkdir()
    names = [f"data-{i:05d}-of-{files:05d}.arrow" for i in range(files)]
    for i, name in enumerate(names):
        part = texts[i::files]
        table = pa.table({"text": part, "label": [0] * len(part)})
        with pa.ipc.new_stream(folder / name, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=100):
                writer.write_batch(batch)
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))


def all_text(corpus) -> str:
    return decode(corpus.train) + decode(corpus.val)


def test_parquet_shards_and_saved_datasets_are_read_row_by_row(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", [f"parquet row {i}." for i in range(3000)], rows_per_group=700)
    write_saved_dataset(tmp_path / "saved", [f"saved row {i}." for i in range(500)])
    (tmp_path / "notes.md").write_text("# notes\n" * 100)
    docs = list(iter_documents(resolve_paths([tmp_path / "a.parquet", tmp_path / "saved"])))
    assert len(docs) == 3500 and docs[0].key == "a.parquet#0" and docs[-1].key.endswith(".arrow#249")
    corpus = load_corpus([str(tmp_path / "*.parquet"), tmp_path / "saved", tmp_path / "notes.md"])
    text = all_text(corpus)
    assert all(f"parquet row {i}." in text for i in range(3000)) and all(f"saved row {i}." in text for i in range(500))
    assert "# notes" in text
    assert corpus.num_documents == 3501 and 0 < len(corpus.val) < len(corpus.train)  # split by row: 5% held out
    # a directory holding them finds them too, the save_to_disk folder through its arrow files
    in_dir = list(iter_documents(resolve_paths([tmp_path])))
    assert sorted(d.text for d in in_dir) == sorted([d.text for d in docs] + ["# notes\n" * 100])


def test_tables_are_streamed_one_record_batch_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.parquet as pq

    write_parquet(tmp_path / "a.parquet", [f"row {i}" for i in range(3000)], rows_per_group=500)
    seen: list[int] = []
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        for batch in iter_batches(self, *args, **kwargs):
            seen.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("read the whole file at once"))
    assert len(list(iter_documents(resolve_paths([tmp_path / "a.parquet"])))) == 3000
    assert sum(seen) == 3000 and max(seen) <= 1024


@pytest.mark.parametrize(
    "columns,message",
    [({"body": ["x"]}, "no 'text' column; its columns: body"), ({"text": [1, 2]}, "not strings")],
)
def test_tables_without_a_text_column_are_refused(tmp_path: Path, columns: dict, message: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=message):
        load_corpus([tmp_path / "t.parquet"])


def test_without_pyarrow_a_table_names_the_extra_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_parquet(tmp_path / "a.parquet", ["text"], rows_per_group=1)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    with pytest.raises(DataError, match=r"swarmloco\[data\]"):
        load_corpus([tmp_path / "a.parquet"])


def test_shards_are_disjoint_cover_the_training_documents_and_share_validation(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    marks = lambda corpus: {i for i in range(60) if f"file {i} " in decode(corpus.train)}
    whole = load_corpus([tmp_path])
    shards = [load_corpus([tmp_path], shard=Shard(index=i, count=3)) for i in range(3)]
    for i, a in enumerate(shards):
        assert marks(a) and torch.equal(a.val, whole.val)
        assert all(not marks(a) & marks(b) for b in shards[i + 1 :]), "two shards share a document"
    assert set().union(*map(marks, shards)) == marks(whole)


def test_a_peer_id_picks_a_stable_shard_and_bad_shards_are_refused(tmp_path: Path) -> None:
    peers = [f"12D3KooWpeer{i}" for i in range(50)]
    picked = [Shard.of_peer(p, 4) for p in peers]
    assert picked == [Shard.of_peer(p, 4) for p in peers] and {s.index for s in picked} == {0, 1, 2, 3}
    with pytest.raises(DataError, match="shards are 0..2"):
        Shard(index=3, count=3)
    (tmp_path / "one.txt").write_text("a single document " * 100)
    with pytest.raises(DataError, match="holds none of the"):  # one document cannot feed two shards
        for i in range(2):
            load_corpus([tmp_path / "one.txt"], shard=Shard(index=i, count=2))


def test_a_local_swarm_gives_each_trainer_its_own_shard() -> None:
    from peer.launch import LocalSwarm, local_config
    from swarm.config import DataConfig, SwarmConfig

    assert local_config(SwarmConfig(), LocalSwarm(peers=4, stages=2, trainers=2)).data.shards == 2
    assert local_config(SwarmConfig(), LocalSwarm(peers=3, stages=2, trainers=1)).data.shards == 1
    sharded = SwarmConfig(data=DataConfig(shards=8))
    assert local_config(sharded, LocalSwarm(peers=4, stages=2, trainers=2)).data.shards == 8


def test_the_validation_windows_do_not_depend_on_the_microbatch_size(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    corpus = load_corpus([tmp_path])
    windows = {b: torch.cat([x for x, _ in corpus.val_batches(batch_size=b, seq_len=16)]) for b in (4, 16)}
    assert windows[4].shape == (VAL_SEQUENCES, 16) and torch.equal(windows[4], windows[16])
    # a batch size that does not divide the count is rounded up to whole batches, never short
    assert [len(x) for x, _ in corpus.val_batches(batch_size=3, seq_len=16, num_sequences=7)] == [3, 3, 3]
