"""The ``swarmloco`` command line (also ``python -m peer``).

$ swarmloco train-local --steps 300 --out runs/baseline
$ swarmloco eval --checkpoint runs/baseline/model.pt
$ swarmloco sample --checkpoint runs/baseline/model.pt --prompt "def " --tokens 200
$ swarmloco export --initial-peers /ip4/…/p2p/12D3… -o model.pt   # the model of a running swarm
$ swarmloco export --checkpoint runs/baseline/model.pt --format hf -o model-hf   # a folder transformers loads
$ swarmloco config show --config swarm.toml   # the effective config, each field's meaning commented
$ swarmloco plan --preset 125m --link 100mbit   # one trainer's tokens/s over those links, and what limits it
$ swarmloco --version

The commands live in peer/commands/; importing them registers them on ``app`` (peer/cli_common.py),
in the order ``swarmloco --help`` lists them. The console script is ``peer/entry.py``'s ``main``, which answers
``--version`` without importing them.
"""

from typing import Annotated

import typer

from peer.cli_common import app
from peer.commands import config, dashboard, one_process, plan, private_swarm, swarm, tokenizer  # noqa: F401  (their decorators register the commands)
from peer.version import DISTRIBUTION, version

__all__ = ["app"]  # what the console script (peer/entry.py) runs


def print_version(given: bool) -> None:
    if given:
        typer.echo(f"{DISTRIBUTION} {version()}")
        raise typer.Exit()


@app.callback()
def root(
    show_version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=print_version, help="Print swarmloco's version and exit."),
    ] = False,
) -> None:
    """The options before any command (the app's help is ``app``'s own, in peer/cli_common.py)."""
