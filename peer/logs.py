"""Logging for every ``swarmloco`` command: one format, a chosen level, the peer's name in each line.

swarmloco's own modules log through ``logging.getLogger(__name__)`` (failed calls, bans, rebalancing,
recoveries, skipped rounds); nothing shows them until a handler is installed, which ``configure``
does once per process. hivemind keeps its own handler; its level follows ours from ``debug`` up.

    >>> configure("info")                 # every command does this from --log-level (peer/cli_common.py)
    >>> set_peer_name("stage1-0")         # `swarmloco run`, once the peer knows its name
    2026-11-23 22:51:07 INFO    [stage1-0] swarm.outer.accountability: stage 1: a strike against 12D3…: …
"""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO, get_args

LogLevel = Literal["debug", "info", "warning", "error"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
DEFAULT_LEVEL: LogLevel = "info"
FORMAT = "%(asctime)s %(levelname)-7s [%(peer)s] %(name)s: %(message)s"
# not logging.getLevelName: hivemind renames WARNING to WARN when imported
NUMERIC: dict[LogLevel, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
OWN_LOGGERS = ("swarm", "peer", "optim", "compress", "__main__")  # the project's packages (and scripts run as main)


class _PeerName(logging.Filter):
    """Stamps each record with the name of the peer this process runs (``-`` before it has one)."""

    name_of_peer = "-"

    def filter(self, record: logging.LogRecord) -> bool:
        record.peer = self.name_of_peer
        return True


_stamp = _PeerName()
_handler: logging.StreamHandler[TextIO] | None = None


def configure(level: LogLevel = DEFAULT_LEVEL) -> None:
    """Send the project's log records at ``level`` and above to stderr in one format; idempotent (the last call wins)."""
    global _handler
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter(FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
        _handler.addFilter(_stamp)
    _handler.stream = sys.stderr  # the stderr of now (a test or an embedding program may have replaced it)
    numeric = NUMERIC[level]
    for name in OWN_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(numeric)
        if _handler not in logger.handlers:
            logger.addHandler(_handler)
        # records still propagate: the root logger has no handler unless something (pytest's caplog) wants them
    # hivemind logs its own internals (p2p daemon, DHT traversals) at info: only with --log-level debug
    logging.getLogger("hivemind").setLevel(max(numeric, logging.WARNING) if level != "debug" else logging.DEBUG)


def set_peer_name(name: str) -> None:
    """Put ``name`` in every later line of this process."""
    _stamp.name_of_peer = name


def current_level() -> LogLevel:
    """The level ``configure`` set (for a launcher to hand on to the peers it starts)."""
    numeric = logging.getLogger(OWN_LOGGERS[0]).getEffectiveLevel()
    return next((name for name, value in NUMERIC.items() if value == numeric), DEFAULT_LEVEL)
