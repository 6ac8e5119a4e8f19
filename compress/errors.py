"""Errors of the bottom layer: ``ConfigError`` for an invalid config value, ``WireError`` for a bad frame.

Every config dataclass raises ``ConfigError`` (``err.within("codecs")`` prefixes a section's name, so the user
reads the full dotted path); decoding bytes from strangers raises nothing but ``WireError``, while encode-side
misuse is a plain ``ValueError`` (docs/architecture.md, compress/).

    >>> try: decode_frame(b"junk")
    ... except WireError as e: print(type(e).__name__)  # BadMagic
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is invalid: ``field`` is its dotted path in the config tree, ``message`` what is wrong.

    >>> err = ConfigError("topk", "must be in [1, 4096], got 0").within("codecs")
    >>> err.field, str(err)  # ('codecs.topk', "config field 'codecs.topk': must be in [1, 4096], got 0")
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)  # both in args, so the error pickles with its field
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"config field '{self.field}': {self.message}"

    def within(self, section: str) -> ConfigError:
        """The same error seen from the enclosing section ``section`` (its dotted path; "" for the root)."""
        return ConfigError(f"{section}.{self.field}" if section else self.field, self.message)


class WireError(ValueError):
    """Base class: the bytes are not a valid frame for this receiver."""


class TruncatedFrame(WireError):
    """The data ends before the header or the lengths it declares."""


class BadMagic(WireError):
    """The data does not start with the swarmloco frame magic."""


class UnsupportedVersion(WireError):
    """The frame's format version is not one this build reads."""


class UnknownCodec(WireError):
    """The codec id is unknown, not the one expected, or not accepted by this receiver."""


class ShapeMismatch(WireError):
    """Declared shape or lengths disagree with the data (or with the receiver's codec setup)."""


class ChecksumMismatch(WireError):
    """The crc32 over the frame does not match: corrupted in transit or tampered with."""


class LimitExceeded(WireError):
    """A declared size (frame, body, metadata, elements, dimensions) is over the receiver's limits."""


class NonFiniteValues(WireError):
    """The decoded tensor holds NaN or ±inf and the caller forbids them."""


class MalformedFrame(WireError):
    """A field holds an impossible value: unknown dtype or flag, corrupt zstd body, index out of range."""
