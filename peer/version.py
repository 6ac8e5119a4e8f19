"""The installed distribution's name and version, without importing torch or hivemind.

>>> version()  # "0.1.0"; "unknown" from a source tree that was never installed
"""

import importlib.metadata

DISTRIBUTION = "swarmloco"


def version() -> str:
    """The installed swarmloco's version; "unknown" when run from a source tree that was never installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
