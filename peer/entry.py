"""The ``swarmloco`` console script (and ``python -m peer``).

``swarmloco --version`` is answered before the commands are imported: they load torch and hivemind (~4 s here) for a
one-line answer. Everything else goes to the typer app in ``peer/cli.py``.

$ swarmloco --version      # swarmloco 0.1.0
"""

import sys

from peer.version import DISTRIBUTION, version


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        print(f"{DISTRIBUTION} {version()}")
        return
    from peer.cli import app  # the commands, and torch and hivemind with them

    app(prog_name=DISTRIBUTION)
