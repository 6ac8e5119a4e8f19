"""A stage server: one middle stage computed for any trainer that calls it.

Forward keeps the decoded input in a cache bounded by count and bytes; backward recomputes the
stage from that input (or from an input the trainer resends when the entry is gone), so no
autograd graph waits in memory between the two calls. Parameter gradients accumulate over the
microbatches served, and an inner AdamW step is taken every ``train.inner_batch`` samples. All
torch work runs on one worker thread: calls are serialised and the event loop stays free to
accept (or refuse) requests.

    >>> server = StageServer(cfg, stage=2)
    >>> servicer = StageServicer(server, stage=2, max_request_bytes=server.max_request_bytes)
    >>> await servicer.add_p2p_handlers(p2p, namespace=cfg.swarm_id)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from hivemind.p2p import PeerID
from hivemind.utils.performance_ema import PerformanceEMA

from compress.wire import WireLimits
from swarm.config import SwarmConfig
from swarm.dht.records import StageStatus
from swarm.model.stages import build_stage
from swarm.model.step import InnerStep, stage_backward, stage_forward
from swarm.pipeline.boundary import boundary_codecs
from swarm.pipeline.protocol import Backward, Forward, RequestError

T = TypeVar("T")
FRAME_SLACK_BYTES = 64 << 10  # frame header, codec metadata and token ids on top of fp32 values


@dataclass
class CacheEntry:
    x: torch.Tensor  # the decoded forward input, (B, T, d)
    tokens: torch.Tensor | None  # token ids the frame carried (subspace codecs), (B, T)
    forward_s: float  # compute time of the forward, counted into the throughput at backward


class ActivationCache:
    """Forward inputs awaiting their backward: least recently stored entries go first when full."""

    def __init__(self, *, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._entries: OrderedDict[Hashable, CacheEntry] = OrderedDict()
        self.nbytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Hashable, entry: CacheEntry) -> None:
        self.pop(key)
        self._entries[key] = entry
        self.nbytes += self._size(entry)
        while len(self._entries) > self.max_items or self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= self._size(old)
            self.evicted += 1

    def pop(self, key: Hashable) -> CacheEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= self._size(entry)
        return entry

    @staticmethod
    def _size(entry: CacheEntry) -> int:
        tokens = 0 if entry.tokens is None else entry.tokens.nbytes
        return entry.x.nbytes + tokens


class StageServer:
    """The ``StageBackend`` of one middle stage (see ``swarm/pipeline/protocol.py``)."""

    def __init__(
        self,
        cfg: SwarmConfig,
        stage: int,
        *,
        start_step: int = 0,
        lr_scale: float = 1.0,
        max_cached: int = 64,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not 1 <= stage <= cfg.stages.num_stages:
            raise ValueError(f"stage must be in [1, {cfg.stages.num_stages}], got {stage}")
        self.cfg, self.stage, self.clock = cfg, stage, clock
        self.module = build_stage(cfg.model, cfg.stages.num_stages, stage)
        self.inner = InnerStep(
            self.module.parameters(),
            cfg.inner,
            inner_batch=cfg.train.inner_batch,
            start_step=start_step,
            lr_scale=lr_scale,
        )
        self.start_step = start_step  # a server that joins mid-run starts at the swarm's point of the lr schedule
        self.first_served_at: float | None = None  # unix time of the first forward served: how long joining took
        self.act_codec, self.grad_codec = boundary_codecs(cfg)
        self.max_batch = cfg.train.microbatch_size
        max_values = self.max_batch * cfg.model.max_seq_len * cfg.model.d_model
        max_frame = 4 * max_values + FRAME_SLACK_BYTES
        self.limits = WireLimits(
            max_frame_bytes=max_frame, max_body_bytes=max_frame, max_elements=max_values, max_ndim=3
        )
        self.max_request_bytes = 2 * max_frame + 1024  # input + gradient frames and the envelope
        self.cache = ActivationCache(max_items=max_cached, max_bytes=max_cached * 4 * max_values)
        self.throughput = PerformanceEMA(alpha=0.1, paused=True)  # samples/s over forward + backward compute
        self.counters: Counter[str] = Counter()
        self.from_stage: Counter[int] = Counter()  # training inputs by the stage they came from: the paths seen
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{stage}")

    async def forward(self, peer: PeerID, request: Forward) -> bytes:
        if not 0 <= request.prev_stage <= self.cfg.stages.num_stages or request.prev_stage == self.stage:
            raise RequestError(
                RequestError.INVALID,
                f"prev_stage {request.prev_stage} is not another stage of 0..{self.cfg.stages.num_stages}",
            )
        x, tokens = self._decode_input(request.x)
        y, elapsed = await self._run(self._compute_forward, x)
        if request.train:
            self.cache.put((peer, request.mb), CacheEntry(x=x, tokens=tokens, forward_s=elapsed))
            self.from_stage[request.prev_stage] += 1
        self.counters["forward" if request.train else "eval_forward"] += 1
        self.first_served_at = self.first_served_at or time.time()
        return self.act_codec.encode(y, tokens=tokens)

    async def backward(self, peer: PeerID, request: Backward) -> bytes:
        entry = self.cache.pop((peer, request.mb))
        if entry is None:
            if request.x is None:
                self.counters["cache_miss"] += 1
                raise RequestError(RequestError.CACHE_MISS, f"no forward input for microbatch {request.mb}; resend it")
            x, tokens = self._decode_input(request.x)
            entry = CacheEntry(x=x, tokens=tokens, forward_s=0.0)
            self.counters["recompute_from_resent"] += 1
        grad = self.grad_codec.decode(request.grad, limits=self.limits)
        if grad.shape != entry.x.shape:
            raise RequestError(
                RequestError.INVALID,
                f"gradient of shape {tuple(grad.shape)} for an input of shape {tuple(entry.x.shape)}",
            )
        grad_x, elapsed = await self._run(self._compute_backward, entry.x, grad)
        self.throughput.update(entry.x.shape[0], interval=entry.forward_s + elapsed)
        self.counters["backward"] += 1
        return self.grad_codec.encode(grad_x)

    def info(self) -> dict[str, Any]:
        return {
            **self.counters,
            "inner_steps": self.inner_steps,
            "samples_per_s": self.samples_per_s,
            "grad_norm": self.inner.grad_norm,
            "cached": len(self.cache),
            "first_served_at": self.first_served_at,
            "evicted": self.cache.evicted,
            "from_stage": {str(k): v for k, v in sorted(self.from_stage.items())},
        }

    @property
    def samples_per_s(self) -> float:
        return self.throughput.samples_per_second if self.throughput.num_updates else 0.0

    def status(self, *, queue: int) -> StageStatus:
        return StageStatus(
            samples_per_s=float(self.samples_per_s),
            queue=queue,
            inner_steps=self.inner_steps,
            grad_norm=float(self.inner.grad_norm),
        )

    async def exclusive(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the compute thread, between requests (the outer step's snapshot and weight install)."""
        return (await self._run(fn))[0]

    def settled(self) -> bool:
        """No forward input awaits its backward: new weights now would not make a backward recompute differ from its forward."""
        return not self.cache

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _decode_input(self, frame: bytes) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, tokens = self.act_codec.decode_with_tokens(frame, limits=self.limits)
        b, t, d = x.shape if x.ndim == 3 else (0, 0, 0)
        if not (1 <= b <= self.max_batch and 1 <= t <= self.cfg.model.max_seq_len and d == self.cfg.model.d_model):
            raise RequestError(
                RequestError.INVALID,
                f"activation of shape {tuple(x.shape)}; expected (B ≤ {self.max_batch}, "
                f"T ≤ {self.cfg.model.max_seq_len}, d = {self.cfg.model.d_model})",
            )
        return x, tokens

    async def _run(self, fn: Callable[..., T], *args: Any) -> tuple[T, float]:
        """``fn(*args)`` on the compute thread, and its compute time (waiting for the thread excluded)."""

        def timed() -> tuple[T, float]:
            started = self.clock()
            return fn(*args), self.clock() - started

        return await asyncio.get_running_loop().run_in_executor(self._executor, timed)

    @property
    def inner_steps(self) -> int:
        return self.inner.steps

    def _compute_forward(self, x: torch.Tensor) -> torch.Tensor:
        return stage_forward(self.module, x)  # (B, T, d) → (B, T, d)

    def _compute_backward(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        grad_x = stage_backward(self.module, x, grad)  # steps 4 and 6 of swarm/model/step.py
        self.inner.add(x.shape[0])
        return grad_x  # (B, T, d)
