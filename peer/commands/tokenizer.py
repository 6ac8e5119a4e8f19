"""``swarmloco tokenizer train``: a byte-level BPE tokenizer trained on local data, for a swarm's config to name.

$ swarmloco tokenizer train --data notes/ --data 'shards/*.parquet' --vocab-size 8192 -o tok.json
$ swarmloco swarm create --name demo --out demo --tokenizer tok.json   # then every trainer: --tokenizer tok.json
"""

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated

import typer

from peer.cli_common import DataOpt, app, fail, user_errors
from peer.data import corpus_files, iter_documents

tokenizer_app = typer.Typer(help="BPE tokenizers trained on local data.", no_args_is_help=True)
app.add_typer(tokenizer_app, name="tokenizer")
PROGRESS_EVERY_BYTES = 16_000_000


@tokenizer_app.command("train")
@user_errors
def tokenizer_train(
    out: Annotated[Path, typer.Option("--out", "-o", help="Tokenizer file to write (tokenizers JSON).")],
    data: DataOpt = None,
    vocab_size: Annotated[
        int,
        typer.Option(
            min=257, help="Ids in the vocabulary: the 256 bytes and the merges learned (fewer if the text runs out)."
        ),
    ] = 8192,
) -> None:
    """Train a byte-level BPE tokenizer (no unknown tokens) on every document of --data."""
    from peer.tokenizer import train_bpe

    if out.exists():
        fail(f"{out} exists, and a swarm config may name it by its sha256: choose another --out or remove it")
    files = corpus_files(data)
    typer.echo(f"tokenizer: training a byte-level BPE of up to {vocab_size} ids on {len(files)} files")
    texts = (doc.text for doc in iter_documents(files))
    tok = train_bpe(with_progress(texts), vocab_size=vocab_size, out=out)
    typer.echo(f"wrote {out}: {tok.vocab_size} ids, sha256 {tok.sha256}")
    typer.echo(f"use it: swarmloco swarm create --name NAME --out DIR --tokenizer {out}")


def with_progress(texts: Iterable[str]) -> Iterator[str]:
    """``texts``, printing how much has been read every PROGRESS_EVERY_BYTES (reading is most of the wait)."""
    documents = size = reported = 0
    for text in texts:
        documents, size = documents + 1, size + len(text)
        if size - reported >= PROGRESS_EVERY_BYTES:
            typer.echo(f"  read {documents} documents, {size / 1e6:.0f} MB")
            reported = size
        yield text
    typer.echo(f"  read {documents} documents, {size / 1e6:.1f} MB; learning merges")
