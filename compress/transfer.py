"""Coded bytes between a tensor's device and the host: one copy each way, the fp32 tensor never leaves its device.

``to_host`` gathers a frame's coded parts (uint8 views of device tensors) into one host buffer — on CUDA a pinned one,
filled by a non-blocking copy and one synchronisation — and ``to_device`` puts a received body where it is decoded.

    >>> meta, body = to_host([(top,), (steps, q)], host_copy(x.device))  # bytes of each group of parts
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from compress.wire import BytesLike

Part = bytes | torch.Tensor  # a piece of a frame: bytes already on the host, or a tensor whose memory is sent as it is


@dataclass(frozen=True, kw_only=True)
class HostCopy:
    """How coded bytes cross between the host and a device: through a separate host buffer (``staged``), page-locked
    (``pinned``: the copy engine reads it directly), copied without blocking the host (``non_blocking``)."""

    staged: bool
    pinned: bool
    non_blocking: bool

    def __post_init__(self) -> None:
        if (self.pinned or self.non_blocking) and not self.staged:
            raise ValueError("pinned or non-blocking copies need a staging buffer")


def host_copy(device: torch.device) -> HostCopy:
    """The copy for ``device``: a CPU tensor's bytes are already on the host; a CUDA one's go through pinned memory
    without blocking (a pageable copy makes the driver stage it itself, synchronously); any other device plainly."""
    if device.type == "cpu":
        return HostCopy(staged=False, pinned=False, non_blocking=False)
    cuda = device.type == "cuda"
    return HostCopy(staged=True, pinned=cuda, non_blocking=cuda)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The memory of ``t`` as a flat uint8 tensor on its device (a view where ``t`` is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def to_host(groups: Sequence[Sequence[Part]], copy: HostCopy | None = None) -> list[bytes]:
    """Each group's parts joined into bytes, in order; every tensor among them crosses to the host in one copy (the
    tensors share a device), after which the host waits once. ``copy``: by default ``host_copy`` of that device."""
    tensors = iter(_gather([flat_bytes(p) for group in groups for p in group if isinstance(p, torch.Tensor)], copy))
    return [b"".join(next(tensors) if isinstance(p, torch.Tensor) else p for p in group) for group in groups]


def _gather(tensors: list[torch.Tensor], copy: HostCopy | None) -> list[memoryview]:
    """The bytes of each (flat uint8) tensor, on the host."""
    if not tensors:
        return []
    device = tensors[0].device
    plan = copy or host_copy(device)
    if not plan.staged:  # already host memory: read in place
        return [t.numpy().data.cast("B") for t in tensors]
    flat = tensors[0] if len(tensors) == 1 else torch.cat(tensors)  # on the device: one copy across, not several
    host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=plan.pinned)
    host.copy_(flat, non_blocking=plan.non_blocking)
    if plan.non_blocking:
        _wait(device)
    view, out, offset = host.numpy().data.cast("B"), [], 0
    for t in tensors:
        out.append(view[offset : offset + t.numel()])
        offset += t.numel()
    return out


def _wait(device: torch.device) -> None:
    """Until the copies queued on ``device``'s current stream are done (the host reads the buffer next)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def to_device(body: BytesLike, device: torch.device, copy: HostCopy | None = None) -> torch.Tensor:
    """``body`` as a uint8 tensor on ``device`` that owns its memory: on the CPU one copy of the received bytes (as a
    decode always made), elsewhere one copy into a (pinned) staging buffer and one across."""
    plan = copy or host_copy(device)
    if not plan.staged:
        return torch.frombuffer(bytearray(body), dtype=torch.uint8) if len(body) else torch.empty(0, dtype=torch.uint8)
    host = torch.empty(len(body), dtype=torch.uint8, pin_memory=plan.pinned)
    host.numpy()[:] = np.frombuffer(body, dtype=np.uint8)
    # a non-blocking copy from pinned memory: the staging buffer is held by the caching allocator until it completes
    return host.to(device, non_blocking=plan.non_blocking)
