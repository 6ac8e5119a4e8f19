"""An outer round's payload on the wire: one frame (``CodecId.OUTER_PAYLOAD``) holding a member's codec frames by
parameter name, and the most bytes one may take.

    >>> round_, frames = unpack_payload(pack_payload(3, {"w": frame}), max_bytes=max_payload_bytes(params))
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import torch

from compress.errors import MalformedFrame, WireError
from compress.wire import BytesLike, CodecId, WireLimits, decode_frame, encode_frame

NamedTensors = Mapping[str, torch.Tensor]

# A payload is one wire frame (CodecId.OUTER_PAYLOAD) whose body is a header, then per parameter: entry header,
# name (utf-8), codec frame. The wire layer zstd-compresses that body as one stream: the names and the parameters'
# frame headers repeat from tensor to tensor, and one stream codes them once (a SparseLoCo payload of the small
# model's middle stage in a real swarm: a median 6,818 → 5,186 bytes per round; docs/benchmarks.md, "Outer payloads
# as one stream").
HEADER = struct.Struct("<QI")  # round, number of parameters
ENTRY = struct.Struct("<HI")  # name length, frame length


def max_payload_bytes(params: NamedTensors) -> int:
    """The most bytes one member's payload for ``params`` may take, encoded or decoded: 8 per parameter (NoLoCo sends
    Δ and the weights in fp32, the densest payload) and room for the names and headers."""
    return 8 * sum(p.numel() for p in params.values()) + (1 << 20)


def pack_payload(round_: int, frames: Mapping[str, bytes]) -> bytes:
    """One member's payload for round ``round_``: its frames by parameter name, as one wire frame."""
    out = [HEADER.pack(round_, len(frames))]
    for name, frame in frames.items():
        encoded = name.encode()
        out += [ENTRY.pack(len(encoded), len(frame)), encoded, frame]
    body = b"".join(out)
    return encode_frame(CodecId.OUTER_PAYLOAD, body, dtype=torch.uint8, shape=(len(body),))


def unpack_payload(data: BytesLike, *, max_bytes: int) -> tuple[int, dict[str, BytesLike]]:
    """Split a payload into (round, {name: frame}); its body may hold at most ``max_bytes`` once decompressed (checked
    before decompressing), and every length inside is checked against the body."""
    limits = WireLimits(max_frame_bytes=max_bytes, max_body_bytes=max_bytes, max_elements=max_bytes, max_ndim=1)
    frame = decode_frame(data, limits=limits)
    if frame.codec_id != CodecId.OUTER_PAYLOAD:
        raise MalformedFrame(f"an outer payload is a frame of codec {int(CodecId.OUTER_PAYLOAD)}, got {frame.codec_id}")
    payload = frame.body
    if len(payload) < HEADER.size:
        raise WireError(f"outer payload of {len(payload)} bytes is shorter than its header")
    round_, count = HEADER.unpack_from(payload)
    frames: dict[str, BytesLike] = {}
    view = memoryview(payload)  # frames are views: decoding a whole-stage payload copies no second stage
    offset = HEADER.size
    for _ in range(count):
        if offset + ENTRY.size > len(payload):
            raise WireError("outer payload truncated inside an entry header")
        name_len, frame_len = ENTRY.unpack_from(payload, offset)
        offset += ENTRY.size
        end = offset + name_len + frame_len
        if end > len(payload):
            raise WireError("outer payload truncated inside an entry")
        name = bytes(payload[offset : offset + name_len]).decode(errors="replace")
        frames[name] = view[offset + name_len : end]
        offset = end
    if offset != len(payload):
        raise WireError(f"outer payload has {len(payload) - offset} trailing bytes")
    if len(frames) != count:
        raise WireError("outer payload names a parameter twice")
    return round_, frames
