"""Tokenizers: the byte tokenizer (the default: 256 ids, no file) and a byte-level BPE trained locally with ``tokenizers``.

The swarm config names its tokenizer (``[data] tokenizer``, and a BPE file's sha256), so peers
with different tokenizers never share a swarm id. Every peer that computes on tokens loads its
``--tokenizer`` file here and checks it against the config (``tokenizer_for``). Byte-level BPE
has no unknown tokens: any text encodes, and decoding gives it back.

    $ swarmloco tokenizer train --data notes/ --vocab-size 4096 -o tok.json
    >>> tok = load_tokenizer(Path("tok.json"))      # load_tokenizer(None) is BYTES
    >>> tok.decode(tok.encode("def f(): pass"))     # 'def f(): pass'
    >>> tok = tokenizer_for(cfg, Path("tok.json"))  # TokenizerError unless cfg names this file
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from swarm.config import SwarmConfig, derive_config

if TYPE_CHECKING:
    import tokenizers

BYTE_VOCAB = 256
MAX_VOCAB = 2**24  # far beyond any useful BPE; keeps a typo (--vocab-size 10000000000) from running for hours


class TokenizerError(ValueError):
    """A tokenizer file is unusable or does not fit the swarm's config; the message says which and why."""


def token_dtype(vocab_size: int) -> type[np.unsignedinteger] | type[np.signedinteger]:
    """The smallest dtype that holds every id of a vocabulary, and that torch fully supports (not uint16): the corpus
    is stored in it."""
    return np.uint8 if vocab_size <= 2**8 else np.int16 if vocab_size <= 2**15 else np.int32


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, nothing to train or ship."""

    kind: str = "bytes"
    sha256: str = ""
    vocab_size: int = BYTE_VOCAB

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(t) for t in ids).decode("utf-8", errors="replace")


class BpeTokenizer:
    """A byte-level BPE (``tokenizers`` JSON file) and the sha256 of that file, which the swarm config names."""

    kind = "bpe"

    def __init__(self, tokenizer: tokenizers.Tokenizer, sha256: str) -> None:
        self.tokenizer, self.sha256 = tokenizer, sha256
        self.vocab_size: int = tokenizer.get_vocab_size()
        self._dtype = token_dtype(self.vocab_size)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text).ids, dtype=self._dtype)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=self._dtype) for e in self.tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(t) for t in ids])


Tokenizer = ByteTokenizer | BpeTokenizer
BYTES = ByteTokenizer()


def import_tokenizers() -> ModuleType:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("BPE tokenizers need the tokenizers package: pip install 'swarmloco[data]'") from None
    return tokenizers


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_tokenizer(path: Path | None) -> Tokenizer:
    """The BPE tokenizer in ``path`` (a ``tokenizers`` JSON file), or BYTES for None."""
    if path is None:
        return BYTES
    HfTokenizer = import_tokenizers().Tokenizer
    try:
        text = path.read_text()
        tokenizer = HfTokenizer.from_str(text)
        model = json.loads(text)["model"]["type"]
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer {path}: {e.strerror or e}") from None
    except Exception as e:  # tokenizers raises plain Exceptions for a malformed file
        raise TokenizerError(
            f"{path} is not a tokenizer file (`swarmloco tokenizer train` writes one): {str(e)[:200]}"
        ) from None
    if model != "BPE":
        raise TokenizerError(f"{path} holds a {model} tokenizer; swarmloco uses BPE (`swarmloco tokenizer train`)")
    return BpeTokenizer(tokenizer, file_sha256(path))


def train_bpe(texts: Iterable[str], *, vocab_size: int, out: Path) -> BpeTokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` ids on ``texts`` (streamed) and save it to ``out``.

    The vocabulary is smaller when the text has fewer distinct merges to learn.
    """
    lib = import_tokenizers()
    models, pre_tokenizers, decoders, trainers = lib.models, lib.pre_tokenizers, lib.decoders, lib.trainers
    if not BYTE_VOCAB < vocab_size <= MAX_VOCAB:
        raise TokenizerError(
            f"--vocab-size must be above {BYTE_VOCAB} (the byte alphabet; 256 is the byte tokenizer) and at most "
            f"{MAX_VOCAB}, got {vocab_size}"
        )
    tokenizer = lib.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[]
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return BpeTokenizer(tokenizer, file_sha256(out))


def check_tokenizer(cfg: SwarmConfig, tokenizer: Tokenizer, path: Path | None = None) -> None:
    """Raise TokenizerError unless ``tokenizer`` (loaded from ``path``) is the one the config names, sized as its model."""
    wanted, given = cfg.data, f"--tokenizer {path}" if path else "the byte tokenizer (no --tokenizer)"
    if wanted.tokenizer == "bpe" and tokenizer.kind != "bpe":
        raise TokenizerError(
            f"this swarm's config uses a BPE tokenizer (sha256 {wanted.tokenizer_sha256[:12]}…): pass its file "
            f"with --tokenizer"
        )
    if wanted.tokenizer == "bytes" and tokenizer.kind != "bytes":
        raise TokenizerError(f"this swarm's config uses the byte tokenizer; run without --tokenizer (given: {path})")
    if tokenizer.sha256 != wanted.tokenizer_sha256:
        raise TokenizerError(
            f"{given} has sha256 {tokenizer.sha256[:12]}…, but this swarm's config names the tokenizer with sha256 "
            f"{wanted.tokenizer_sha256[:12]}…: use the swarm's own tokenizer file"
        )
    if tokenizer.kind == "bpe" and cfg.model.vocab_size != tokenizer.vocab_size:
        raise TokenizerError(
            f"{given} has {tokenizer.vocab_size} ids, but model.vocab_size is {cfg.model.vocab_size}; "
            f"they must be equal (`swarmloco swarm create --tokenizer` sets both)"
        )
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise TokenizerError(
            f"model.vocab_size {cfg.model.vocab_size} is smaller than {given}'s {tokenizer.vocab_size} ids"
        )


def tokenizer_for(cfg: SwarmConfig, path: Path | None) -> Tokenizer:
    """The tokenizer in ``path`` (BYTES for None), checked against the swarm config ``cfg``."""
    tokenizer = load_tokenizer(path)
    check_tokenizer(cfg, tokenizer, path)
    return tokenizer


def with_tokenizer(cfg: SwarmConfig, tokenizer: Tokenizer) -> SwarmConfig:
    """``cfg`` made to use ``tokenizer``: ``[data]`` names it and ``model.vocab_size`` fits it."""
    overrides: dict[str, str | int] = {"data.tokenizer": tokenizer.kind, "data.tokenizer_sha256": tokenizer.sha256}
    if tokenizer.kind == "bpe":
        overrides["model.vocab_size"] = tokenizer.vocab_size
    return derive_config(cfg, overrides)


def config_and_tokenizer(cfg: SwarmConfig | None, path: Path | None) -> tuple[SwarmConfig, Tokenizer]:
    """A one-process command's config and tokenizer: a given config must name ``path``'s tokenizer; without one
    (None), the built-in config takes it."""
    if cfg is None:
        tokenizer = load_tokenizer(path)
        return with_tokenizer(SwarmConfig(), tokenizer), tokenizer
    return cfg, tokenizer_for(cfg, path)
