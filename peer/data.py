"""Training data: a byte-level tokenizer and a corpus of local text files.

No downloads: the default corpus is the Python standard library's source of the running
interpreter, real text present on every machine. The train/validation split is by file and
deterministic (a hash of each file's path relative to its root), so every peer agrees on it.

    >>> corpus = load_corpus()                        # or load_corpus(["notes/", "*.md"])
    >>> x, y = next(corpus.sample_batches("train", batch_size=16, seq_len=128, seed=1))  # (16, 128) int64 each
"""

from __future__ import annotations

import glob
import hashlib
import json
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl")
VAL_PERCENT = 5  # share of files held out for validation
EXCLUDED_STDLIB_DIRS = {"site-packages", "test", "tests", "__pycache__"}


class DataError(ValueError):
    """The corpus cannot be used; the message names the path."""


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens: Sequence[int] | torch.Tensor) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def default_corpus_paths() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*.py") if not EXCLUDED_STDLIB_DIRS & set(p.relative_to(stdlib).parts))


def resolve_paths(specs: Sequence[str | Path]) -> list[tuple[Path, Path]]:
    """Expand files, directories and globs into (file, root) pairs; root makes the split path-independent."""
    found: list[tuple[Path, Path]] = []
    for spec in specs:
        spec_path = Path(spec)
        if spec_path.is_file():
            found.append((spec_path, spec_path.parent))
        elif spec_path.is_dir():
            found += [(p, spec_path) for p in sorted(spec_path.rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES]
        else:
            matches = sorted(Path(m) for m in glob.glob(str(spec), recursive=True))
            files = [(p, p.parent) for p in matches if p.is_file() and p.suffix in TEXT_SUFFIXES]
            if not files:
                raise DataError(f"data path {spec!s} matches no readable {'/'.join(TEXT_SUFFIXES)} file")
            found += files
    if not found:
        raise DataError(f"no text files ({'/'.join(TEXT_SUFFIXES)}) under {', '.join(map(str, specs))}")
    return found


def read_text_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    if path.suffix != ".jsonl":
        return raw
    texts = []
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if line.strip():
            try:
                texts.append(str(json.loads(line)["text"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataError(f"{path}:{n}: expected a JSON object with a 'text' field") from None
    return "\n\n".join(texts).encode("utf-8")


def is_validation_file(relative: str) -> bool:
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % 100 < VAL_PERCENT


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # (N,) uint8 bytes, files joined by a blank line
    val: torch.Tensor  # (M,) uint8
    num_files: int

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
        self, *, batch_size: int, seq_len: int, num_batches: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed held-out set: evenly spaced windows over the validation split (same on every peer)."""
        data = self._split("val", seq_len)
        count = batch_size * num_batches
        starts = torch.linspace(0, len(data) - seq_len - 1, count).long()
        return [self._windows(data, starts[i : i + batch_size], seq_len) for i in range(0, count, batch_size)]

    def _split(self, split: str, seq_len: int) -> torch.Tensor:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = self.train if split == "train" else self.val
        if len(data) < seq_len + 2:
            raise DataError(
                f"the {split} split has {len(data)} bytes, fewer than one window of {seq_len + 1}; add more text"
            )
        return data

    @staticmethod
    def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(seq_len + 1)  # (B, T+1)
        window = data[idx].long()
        return window[:, :-1], window[:, 1:]


def load_corpus(paths: Sequence[str | Path] | None = None) -> Corpus:
    """Read a corpus (default: the stdlib sources) and split it by file into train and validation."""
    if paths:
        files = resolve_paths(paths)
    else:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = [(p, stdlib) for p in default_corpus_paths()]
    train_parts, val_parts = [], []
    for path, root in files:
        text = read_text_bytes(path)
        if text:
            relative = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
            (val_parts if is_validation_file(relative) else train_parts).append(text)
    if not train_parts and not val_parts:
        raise DataError(f"every file under {', '.join(map(str, paths or ['the stdlib']))} is empty")
    if not val_parts or not train_parts:  # tiny corpora (a single file): hold out the tail instead
        joined = b"\n\n".join(train_parts + val_parts)
        cut = int(len(joined) * (1 - VAL_PERCENT / 100))
        train_parts, val_parts = [joined[:cut]], [joined[cut:]]
    as_tensor = lambda parts: torch.from_numpy(np.frombuffer(b"\n\n".join(parts), dtype=np.uint8).copy())
    return Corpus(train=as_tensor(train_parts), val=as_tensor(val_parts), num_files=len(files))
