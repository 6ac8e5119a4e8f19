"""What a microbatch sends along its hops: its identity (``Microbatch``), each hop taken (``Hop``), a boundary tensor
encoded once per codec its links ask for (``Outgoing``), and the one place a link's codec is chosen (``LinkCodecs``).

    >>> codecs = LinkCodecs({"activations": activations, "gradients": gradients})  # boundary.boundary_ladders(cfg)
    >>> frame = Outgoing(h, tokens).frame(codecs.choose("activations", peer, (8, 1024, 768)))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from compress.adaptive import Ladder, LinkEstimator, choose_codec
from compress.codec_base import Codec
from swarm.pipeline.routing import Peer


@dataclass(frozen=True)
class Microbatch:
    id: str
    shape: tuple[int, ...]  # (B, T, d): every activation and gradient frame it sends has this shape
    train: bool
    path: tuple[int, ...] = ()  # the stages it goes through, in order: a check takes a hop's output down the rest
    # (B, T), a training or validation microbatch's: the loss a checked output gives is taken against them (labels
    # stay here); None: its forwards are not checked
    targets: torch.Tensor | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Hop:
    stage: int
    peer: Peer
    x: bytes  # the frame this hop received: resent if its server loses it
    x_codec: str  # its codec
    prev_stage: int  # the stage x came from (a probe's forward names it, as the hop's did)
    weights: tuple[int, int] | None = None  # the weights its forward ran on, as the server said: a probe runs on them


# (codec, tensor, token ids) → the frame: ``Codec.encode``, or a paced trainer's (``Pace.encode``, pacing.py)
Encoder = Callable[[Codec, torch.Tensor, torch.Tensor | None], bytes]


class Outgoing:
    """A boundary tensor on its way to the next hop: encoded once per codec a link asks for, the frame it arrived in
    relayed as is when the link's codec is that frame's (no second rounding)."""

    def __init__(
        self,
        value: torch.Tensor,
        tokens: torch.Tensor | None,
        frame: bytes | None = None,
        codec: Codec | None = None,
        *,
        encode: Encoder | None = None,
    ) -> None:
        self.value, self.tokens, self._encode = value, tokens, encode
        self._frames: dict[str, bytes] = {} if frame is None or codec is None else {codec.name: frame}

    def frame(self, codec: Codec) -> bytes:
        if codec.name not in self._frames:
            encoded = (
                codec.encode(self.value, tokens=self.tokens)
                if self._encode is None
                else self._encode(codec, self.value, self.tokens)
            )
            self._frames[codec.name] = encoded
        return self._frames[codec.name]


class LinkCodecs:
    """The codec of every frame a trainer sends, per kind and destination peer: the one place the choice is made.

    Each kind has its ladder (a fixed codec: a ladder of one); links are measured from the RPCs that complete
    (``observe``), and ``report`` says per link what was chosen last and what was measured."""

    def __init__(self, ladders: dict[str, Ladder]) -> None:
        self.ladders = ladders  # "activations", "gradients"
        self.links = LinkEstimator()
        self.chosen: dict[Peer, dict[str, str]] = {}

    def choose(self, kind: str, peer: Peer, shape: tuple[int, ...]) -> Codec:
        codec = choose_codec(self.ladders[kind], shape, self.links.get(peer))
        self.chosen.setdefault(peer, {})[kind] = codec.name
        return codec

    def observe(self, peer: Peer, reply: bytes, *, nbytes: int, elapsed_s: float) -> None:
        server_s, compute_s = getattr(reply, "server_s", None), getattr(reply, "compute_s", None)
        self.links.observe(peer, nbytes=nbytes, elapsed_s=elapsed_s, server_s=server_s, compute_s=compute_s)

    def report(self) -> dict[str, dict[str, Any]]:
        """Per peer: the codec chosen last for each kind, and the link's estimated bytes/s and compute per call."""
        report = {}
        for peer, chosen in self.chosen.items():
            link = self.links.get(peer)
            measured = {} if link is None else {"bytes_per_s": link.bytes_per_s, "compute_s": link.compute_s}
            report[str(peer)] = {**{f"codec_{kind}": name for kind, name in chosen.items()}, **measured}
        return report
