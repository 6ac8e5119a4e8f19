"""The frames a stage server receives: its inputs and their gradients, decoded onto its device on a thread of their
own, within the limits one microbatch of the model can need, and the inputs checked against the model's shapes.

    >>> inbound = InboundFrames(cfg, device=device); codec, x, tokens = await inbound.input(request.x, times)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from compress.codec_base import BOUNDARY_MAX_ABS, Codec
from compress.wire import WireLimits
from swarm.config import SwarmConfig
from swarm.hardware import CPU
from swarm.pipeline.boundary import boundary_ladders
from swarm.pipeline.timing import RequestTimes
from swarm.rpc.servicer import RequestError

FRAME_SLACK_BYTES = 64 << 10  # frame header, codec metadata and token ids on top of fp32 values
Decoded = tuple[Codec, torch.Tensor, torch.Tensor | None]  # a frame's codec, its tensor (on the device), token ids


def boundary_limits(cfg: SwarmConfig) -> WireLimits:
    """What a stage server decodes at most: one microbatch of fp32 activations of the model's width and length."""
    max_values = cfg.train.microbatch_size * cfg.model.max_seq_len * cfg.model.d_model
    max_frame = 4 * max_values + FRAME_SLACK_BYTES
    return WireLimits(
        max_frame_bytes=max_frame,
        max_body_bytes=max_frame,
        max_elements=max_values,
        max_ndim=3,
        max_abs=BOUNDARY_MAX_ABS,  # an int8 scale of 3.4e38 is refused here, before any compute
    )


class InboundFrames:
    """A stage server's decoding of what it receives, in the codecs its boundaries accept (it replies in the
    request's own: the trainer chose it for their link)."""

    def __init__(
        self,
        cfg: SwarmConfig,
        *,
        device: torch.device = CPU,
        clock: Callable[[], float] = time.perf_counter,
        name: str = "stage-decode",
    ) -> None:
        self.cfg, self.device, self.clock = cfg, device, clock
        self.act_codecs, self.grad_codecs = boundary_ladders(cfg)
        self.max_batch = cfg.train.microbatch_size
        self.limits = boundary_limits(cfg)
        self.max_request_bytes = 2 * self.limits.max_frame_bytes + 1024  # input + gradient frames and the envelope
        # frames are decoded onto the device on a thread of their own: beside the compute (as on the event loop
        # before), and a decode's wait for the device (its finiteness check) blocks neither the loop nor the compute
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def input(self, frame: bytes, times: RequestTimes) -> Decoded:
        """An input activation (B, T, d), refused unless of the model's width, at most its length and a microbatch."""
        return await self._decoded(self._decode_input, frame, times)

    async def gradient(self, frame: bytes, times: RequestTimes) -> Decoded:
        """The gradient of an output, (B, T, d): checked against its input's shape by the server."""
        return await self._decoded(self._decode_gradient, frame, times)

    def shutdown(self) -> None:
        self._decoder.shutdown(wait=True, cancel_futures=True)

    async def _decoded(self, decode: Callable[[bytes], Decoded], frame: bytes, times: RequestTimes) -> Decoded:
        """``decode(frame)`` onto the device (only its coded bytes cross: int8 is a quarter of fp32) on the decoding
        thread, its time into ``times.decode_s``. On the event loop, the decode's finiteness check would wait for the
        device behind every forward and backward queued before it."""
        started = self.clock()
        decoded = await asyncio.get_running_loop().run_in_executor(self._decoder, decode, frame)
        times.decode_s = self.clock() - started
        return decoded

    def _decode_gradient(self, frame: bytes) -> Decoded:
        return self.grad_codecs.decode(frame, limits=self.limits, device=self.device)

    def _decode_input(self, frame: bytes) -> Decoded:
        codec, x, tokens = self.act_codecs.decode(frame, limits=self.limits, device=self.device)
        b, t, d = x.shape if x.ndim == 3 else (0, 0, 0)
        if not (1 <= b <= self.max_batch and 1 <= t <= self.cfg.model.max_seq_len and d == self.cfg.model.d_model):
            raise RequestError(
                RequestError.INVALID,
                f"activation of shape {tuple(x.shape)}; expected (B ≤ {self.max_batch}, "
                f"T ≤ {self.cfg.model.max_seq_len}, d = {self.cfg.model.d_model})",
            )
        return codec, x, tokens
