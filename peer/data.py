"""Training data: documents from local files, tokenized, split into train and validation, and sharded among trainers.

No downloads: the default corpus is the Python standard library's source of the running
interpreter, real text present on every machine. ``--data`` also reads tables with a ``text``
column, streamed one record batch at a time: parquet shards and Hugging Face ``datasets`` saved
to disk (``Dataset.save_to_disk`` folders), both through pyarrow (``pip install 'swarmloco[data]'``).

A document is a text file or one row of a table (``.jsonl`` line, parquet or arrow row). Its key
(path relative to the ``--data`` root, ``#row`` for a row) decides, by hash, whether it is
validation (the same on every peer) and which of ``count`` shards it trains in: a trainer reads
the validation documents and its own shard's training documents only.

    >>> corpus = load_corpus()                        # or load_corpus(["notes/", "*.parquet"], tokenizer=tok)
    >>> corpus = load_corpus(["data/"], shard=Shard(index=1, count=4))   # a quarter of the training documents
    >>> x, y = next(corpus.sample_batches("train", batch_size=16, seq_len=128, seed=1))  # (16, 128) int64 each
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import itertools
import json
import re
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peer.tokenizer import BYTES, Tokenizer, token_dtype

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl")
TABLE_SUFFIXES = (".parquet", ".arrow")  # read with pyarrow, a text column
SUFFIXES = TEXT_SUFFIXES + TABLE_SUFFIXES
HF_STATE = "state.json"  # Dataset.save_to_disk writes it beside its arrow files
TEXT_COLUMN = "text"
VAL_PERCENT = 5  # share of documents held out for validation
# held-out windows every validation loss is measured on: a count of sequences, not of batches, so the set stays the
# same whatever the microbatch size (a smaller microbatch makes more, smaller validation batches of the same windows)
VAL_SEQUENCES = 256
ROWS_PER_BATCH = 1024  # rows read from a table at once
DOCS_PER_ENCODE = 256  # documents tokenized in one call
SEPARATOR = "\n\n"  # between documents
EXCLUDED_STDLIB_DIRS = {"site-packages", "test", "tests", "__pycache__"}
# A text file's first TEXT_SNIFF_BYTES decide whether it is text: refused if more than BINARY_SHARE of them are not
# valid UTF-8 or are control bytes (random bytes: about half; text in UTF-8: none; latin-1 prose: a few percent)
TEXT_SNIFF_BYTES = 64 << 10
BINARY_SHARE = 0.10
# an invalid UTF-8 byte (as surrogateescape decodes it) or a control character text does not hold (tab, newlines,
# vertical tab, form feed and escape are text)
NOT_TEXT = re.compile("[\udc80-\udcff\x00-\x08\x0e-\x1a\x1c-\x1f\x7f]")


class DataError(ValueError):
    """The corpus cannot be used; the message names the path."""


def encode(text: str, tokenizer: Tokenizer = BYTES) -> torch.Tensor:
    return torch.from_numpy(tokenizer.encode(text).astype(np.int64))


def decode(tokens: Sequence[int] | torch.Tensor, tokenizer: Tokenizer = BYTES) -> str:
    return tokenizer.decode(tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)


def key_hash(kind: str, key: str) -> int:
    return int(hashlib.sha256(f"{kind}{key}".encode()).hexdigest(), 16)


def is_validation_file(relative: str) -> bool:
    """Whether the document with this key is held out for validation (the same on every peer)."""
    return key_hash("", relative) % 100 < VAL_PERCENT


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: the training documents whose key hashes there (validation is never sharded).

    ``Shard.of_peer`` derives the index from a peer id. Hashed indices collide: two trainers share a
    shard with probability 1/count (with T trainers, some pair does with probability about
    1 - e^(-T(T-1)/2count)); give trainers ``--data-shard`` explicitly to rule that out.
    """

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise DataError(f"data shard {self.index} does not exist: shards are 0..{self.count - 1} (data.shards)")

    @classmethod
    def of_peer(cls, peer_id: str, count: int) -> Shard:
        return cls(index=key_hash("peer/", peer_id) % count, count=count)

    def holds(self, key: str) -> bool:
        return self.count == 1 or key_hash("shard/", key) % self.count == self.index


WHOLE = Shard()


@dataclass(frozen=True)
class Document:
    key: str  # path relative to its --data root, "#row" appended for a table's row
    text: str


def default_corpus_paths() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*.py") if not EXCLUDED_STDLIB_DIRS & set(p.relative_to(stdlib).parts))


def resolve_paths(specs: Sequence[str | Path]) -> list[tuple[Path, Path]]:
    """Expand files, directories (a ``save_to_disk`` folder: its arrow files) and globs into (file, root) pairs; root
    makes document keys, and so the split and the shards, independent of where the corpus lives."""
    found: list[tuple[Path, Path]] = []
    for spec in specs:
        spec_path = Path(spec)
        if spec_path.is_file():
            found.append((spec_path, spec_path.parent))
        elif (spec_path / HF_STATE).is_file():
            found += [(p, spec_path) for p in saved_dataset_files(spec_path)]
        elif spec_path.is_dir():
            found += [(p, spec_path) for p in sorted(spec_path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES]
        else:
            matches = sorted(Path(m) for m in glob.glob(str(spec), recursive=True))
            files = [(p, p.parent) for p in matches if p.is_file() and p.suffix in SUFFIXES]
            if not files:
                raise DataError(f"data path {spec!s} matches no readable {'/'.join(SUFFIXES)} file")
            found += files
    if not found:
        raise DataError(f"no text files or tables ({'/'.join(SUFFIXES)}) under {', '.join(map(str, specs))}")
    return found


def corpus_files(paths: Sequence[str | Path] | None) -> list[tuple[Path, Path]]:
    """(file, root) pairs of ``--data`` specs, or of the stdlib sources when none are given."""
    if paths:
        return resolve_paths(paths)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(p, stdlib) for p in default_corpus_paths()]


def saved_dataset_files(folder: Path) -> list[Path]:
    """The arrow files of a ``Dataset.save_to_disk`` folder, in the order its state.json lists them."""
    try:
        files = [folder / entry["filename"] for entry in json.loads((folder / HF_STATE).read_text())["_data_files"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        raise DataError(f"{folder / HF_STATE} is not a datasets state file (expected a _data_files list)") from None
    missing = [p for p in files if not p.is_file()]
    if missing or not files:
        raise DataError(f"{folder} lists data files it does not hold: {', '.join(map(str, missing)) or 'none'}")
    return files


def iter_documents(files: Iterable[tuple[Path, Path]]) -> Iterator[Document]:
    """Every document of every file, streamed: a text file whole, a table (and .jsonl) row by row."""
    for path, root in files:
        relative = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
        if path.suffix == ".jsonl":
            texts: Iterable[str] = jsonl_texts(path)
        elif path.suffix in TABLE_SUFFIXES:
            texts = table_texts(path)
        else:
            yield Document(relative, read_text(path))
            continue
        for row, text in enumerate(texts):
            yield Document(f"{relative}#{row}", text)


def read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def read_text(path: Path) -> str:
    """A text file's content, decoded as UTF-8 (a stray invalid byte replaced); DataError if it is not text."""
    data = read_file(path)
    check_text(path, data)
    return data.decode("utf-8", errors="replace")


def check_text(path: Path, data: bytes) -> None:
    """Refuse binary content (random bytes, a model, an archive, UTF-16 text) from the first bytes only, so large
    corpora cost nothing more: the share of them that are not valid UTF-8 or are control bytes."""
    prefix = data[:TEXT_SNIFF_BYTES]
    # incremental and not final: a character cut by the prefix's end is held back, not counted as invalid
    text = codecs.getincrementaldecoder("utf-8")("surrogateescape").decode(prefix, final=len(data) <= len(prefix))
    bad = len(NOT_TEXT.findall(text))
    if bad > BINARY_SHARE * len(prefix):
        first = "first 64 KiB" if len(data) > TEXT_SNIFF_BYTES else f"{len(prefix)} bytes"
        raise DataError(
            f"{path} does not look like text: {bad / len(prefix):.0%} of its {first} are not valid UTF-8 or are "
            f"control bytes; pass UTF-8 text, .jsonl, parquet or arrow files"
        )


def jsonl_texts(path: Path) -> Iterator[str]:
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if line.strip():
            try:
                yield str(json.loads(line)[TEXT_COLUMN])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataError(f"{path}:{n}: expected a JSON object with a 'text' field") from None


def table_texts(path: Path) -> Iterator[str]:
    """The ``text`` column of a parquet or arrow (IPC stream or file) table, one record batch in memory at a time."""
    pa = import_pyarrow(path)
    try:
        schema, batches = open_table(pa, path)
        if TEXT_COLUMN not in schema.names:
            raise DataError(f"{path} has no {TEXT_COLUMN!r} column; its columns: {', '.join(schema.names)}")
        kind = schema.field(TEXT_COLUMN).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            raise DataError(f"{path}: column {TEXT_COLUMN!r} holds {kind}, not strings")
        for batch in batches:
            yield from (text or "" for text in batch.column(TEXT_COLUMN).to_pylist())  # a null row: an empty document
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot read {path}: {e}") from None


def open_table(pa: Any, path: Path) -> tuple[Any, Iterator[Any]]:
    """(schema, record batches) of a parquet file or an arrow IPC file (datasets writes the stream format)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        return parquet.schema_arrow, parquet.iter_batches(
            batch_size=ROWS_PER_BATCH, columns=[TEXT_COLUMN] if TEXT_COLUMN in names else None
        )
    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
        return reader.schema, iter(reader)
    except pa.ArrowInvalid:  # not the stream format: the random-access file format
        file = pa.ipc.open_file(source)
        return file.schema, (file.get_batch(i) for i in range(file.num_record_batches))


def import_pyarrow(path: Path) -> Any:
    try:
        import pyarrow
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install 'swarmloco[data]'") from None
    return pyarrow


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # (N,) token ids (uint8 bytes, int16 or int32 for a larger vocabulary), documents joined
    val: torch.Tensor  # (M,) the validation documents, the same on every peer
    num_files: int
    num_documents: int = 0  # documents read (validation and this shard's training documents)

    def sample_batches(
        self, split: str, *, batch_size: int, seq_len: int, seed: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Infinite stream of random (inputs, targets) windows, (B, T) int64 each; one stream per seed."""
        data = self._split(split, seq_len)
        g = torch.Generator().manual_seed(seed)
        while True:
            starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
            yield self._windows(data, starts, seq_len)

    def val_batches(
        self, *, batch_size: int, seq_len: int, num_sequences: int = VAL_SEQUENCES
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed held-out set: ``num_sequences`` evenly spaced windows over the validation split (same on every peer),
        in batches of ``batch_size`` (rounded up to whole batches, so any batch size dividing the count sees the same
        windows).

            >>> len(corpus.val_batches(batch_size=4, seq_len=128))  # 64 batches of the 256 default windows
        """
        data = self._split("val", seq_len)
        count = batch_size * -(-num_sequences // batch_size)
        starts = torch.linspace(0, len(data) - seq_len - 1, count).long()
        return [self._windows(data, starts[i : i + batch_size], seq_len) for i in range(0, count, batch_size)]

    def _split(self, split: str, seq_len: int) -> torch.Tensor:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = self.train if split == "train" else self.val
        if len(data) < seq_len + 2:
            raise DataError(
                f"the {split} split has {len(data)} tokens, fewer than one window of {seq_len + 1}; add more text"
            )
        return data

    @staticmethod
    def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(seq_len + 1)  # (B, T+1)
        window = data[idx].long()
        return window[:, :-1], window[:, 1:]


def load_corpus(
    paths: Sequence[str | Path] | None = None, *, tokenizer: Tokenizer = BYTES, shard: Shard = WHOLE
) -> Corpus:
    """Read and tokenize a corpus (default: the stdlib sources): the validation documents and ``shard``'s training ones."""
    files = corpus_files(paths)
    where = ", ".join(map(str, paths or ["the stdlib"]))
    train: list[np.ndarray] = []
    val: list[np.ndarray] = []
    other_shards = 0
    for docs in batched(d for d in iter_documents(files) if d.text):
        held_out = [is_validation_file(d.key) for d in docs]
        mine = [not v and shard.holds(d.key) for d, v in zip(docs, held_out)]
        other_shards += sum(not v and not m for v, m in zip(held_out, mine))
        kept = [(d, v) for d, v, m in zip(docs, held_out, mine) if v or m]
        for (_, is_val), tokens in zip(kept, encode_documents([d for d, _ in kept], tokenizer)):
            (val if is_val else train).append(tokens)
    if not train and not val and not other_shards:
        raise DataError(f"every file under {where} is empty")
    if not val or not (train or other_shards):  # tiny corpora (a single file): hold out the tail instead
        return tail_split(files, tokenizer, shard)
    if not train:
        raise DataError(
            f"data shard {shard.index} of {shard.count} holds none of the {other_shards} training documents: use "
            f"fewer shards (data.shards) or more documents"
        )
    sep = tokenizer.encode(SEPARATOR)
    return Corpus(
        train=join(train, sep, tokenizer),
        val=join(val, sep, tokenizer),
        num_files=len(files),
        num_documents=len(train) + len(val),
    )


def tail_split(files: list[tuple[Path, Path]], tokenizer: Tokenizer, shard: Shard) -> Corpus:
    """A corpus too small to split by document: every document joined, the last VAL_PERCENT held out (the same on
    every peer); the training text is this shard's documents up to there."""
    docs = [d for d in iter_documents(files) if d.text]
    tokens = [t for chunk in batched(docs) for t in encode_documents(chunk, tokenizer)]
    sep = tokenizer.encode(SEPARATOR)
    joined = join(tokens, sep, tokenizer)
    cut = int(len(joined) * (1 - VAL_PERCENT / 100))
    starts = np.cumsum([0] + [len(t) + len(sep) for t in tokens[:-1]])
    mine = [t[: max(0, cut - start)] for d, t, start in zip(docs, tokens, starts) if shard.holds(d.key)]
    if shard.count > 1 and not any(len(t) for t in mine):
        raise DataError(
            f"data shard {shard.index} of {shard.count} holds none of the {len(docs)} documents: use fewer shards "
            f"(data.shards) or more documents"
        )
    train = joined[:cut] if shard.count == 1 else join([t for t in mine if len(t)], sep, tokenizer)
    return Corpus(train=train, val=joined[cut:], num_files=len(files), num_documents=len(docs))


def batched(docs: Iterable[Document]) -> Iterator[list[Document]]:
    it = iter(docs)
    while chunk := list(itertools.islice(it, DOCS_PER_ENCODE)):
        yield chunk


def encode_documents(docs: Sequence[Document], tokenizer: Tokenizer) -> list[np.ndarray]:
    return tokenizer.encode_batch([d.text for d in docs]) if docs else []


def join(parts: Sequence[np.ndarray], sep: np.ndarray, tokenizer: Tokenizer) -> torch.Tensor:
    """Documents joined by ``sep``, in the smallest dtype that holds the vocabulary."""
    dtype = token_dtype(tokenizer.vocab_size)
    pieces = [piece for part in parts for piece in (sep, part)][1:]
    return torch.from_numpy(np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype))
