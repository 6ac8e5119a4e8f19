"""The ``swarmloco`` command line (also ``python -m peer``).

$ swarmloco train-local --steps 300 --out runs/baseline
$ swarmloco eval --checkpoint runs/baseline/model.pt
$ swarmloco sample --checkpoint runs/baseline/model.pt --prompt "def " --tokens 200
$ swarmloco export --initial-peers /ip4/…/p2p/12D3… -o model.pt   # the model of a running swarm
$ swarmloco export --checkpoint runs/baseline/model.pt --format hf -o model-hf   # a folder transformers loads

The commands live in peer/commands/; importing them registers them on ``app`` (peer/cli_common.py),
in the order ``swarmloco --help`` lists them.
"""

import sys

from peer.cli_common import app
from peer.commands import dashboard, one_process, private_swarm, swarm, tokenizer  # noqa: F401  (their decorators register the commands)

__all__ = ["app", "main"]


def main() -> None:
    app(prog_name="swarmloco")


if __name__ == "__main__":
    sys.exit(main())
