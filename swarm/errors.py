"""Error types shared across the swarm packages.

``ConfigError`` is defined once, in the bottom layer (compress/), and re-exported here so that
swarm/ and peer/ code keeps importing it from ``swarm.errors``.
"""

from compress.errors import ConfigError

__all__ = ["ConfigError"]
