"""Error types shared across the swarm packages."""


class ConfigError(ValueError):
    """A configuration value is invalid; ``field`` is its dotted path (e.g. ``model.d_model``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"config field '{field}': {problem}")
        self.field = field
