"""Error types shared across the swarm packages.

``ConfigError`` is defined once, in the bottom layer (compress/), and re-exported here so that
swarm/ and peer/ code keeps importing it from ``swarm.errors``. Errors defined here need no hivemind
to import (an export from a checkpoint never loads it).
"""

from compress.errors import ConfigError

__all__ = ["ConfigError", "ExportError"]


class ExportError(RuntimeError):
    """The model cannot be exported as asked: a stage of the swarm has no live replica (or none delivered), or the
    format or destination does not fit the model."""
