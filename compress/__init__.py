"""Codecs and the wire format for everything a peer sends: activations, their gradients, pseudo-gradients."""

from compress import lowrank, rotated  # noqa: F401  (they add rot4/2/1, lowrank16/32 to get_codec's registry)
from compress.codec_base import Codec
from compress.codecs import get_codec
from compress.errors import WireError
from compress.sparseloco import SparseLoCoCodec, SparseLoCoState, SparseTensor, aggregate_mean
from compress.wire import DEFAULT_LIMITS, WireLimits, decode_frame, encode_frame

__all__ = [
    "Codec",
    "get_codec",
    "WireError",
    "SparseLoCoCodec",
    "SparseLoCoState",
    "SparseTensor",
    "aggregate_mean",
    "DEFAULT_LIMITS",
    "WireLimits",
    "decode_frame",
    "encode_frame",
]
