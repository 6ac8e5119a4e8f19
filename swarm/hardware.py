"""Where a peer computes: the device it picks (``--device``), the memory that device has free, and the precision it computes in.

Weights, gradients and optimizer states stay fp32 on every device; ``[train] precision = "bf16"`` runs the forward
and backward under ``torch.autocast``, and the tensors on the wire stay fp32 (docs/architecture.md, Devices).

    >>> with compute_precision(resolve_device("auto"), "bf16"): loss = model(tokens)  # auto: cuda, else mps, else cpu
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Literal, get_args

import torch

from swarm.errors import ConfigError

CPU = torch.device("cpu")
Precision = Literal["fp32", "bf16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
DEVICE_SPEC = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
DEVICE_HELP = "Where to compute: auto (a CUDA GPU if there is one, else Apple mps, else cpu), cpu, cuda, cuda:N or mps."


def device_spec_problem(spec: str) -> str | None:
    """Why ``spec`` names no device at all (None when its form is right; whether this machine has it is apart)."""
    return None if DEVICE_SPEC.match(spec) else f"must be auto, cpu, cuda, cuda:N or mps, got {spec!r}"


def resolve_device(spec: str) -> torch.device:
    """The device ``spec`` names; ConfigError (naming ``--device``) when it is malformed or not on this machine."""
    if (problem := device_spec_problem(spec)) is not None:
        raise ConfigError("--device", problem)
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("mps") if torch.backends.mps.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device", f"{spec}: this machine has no CUDA GPU (or torch was built without CUDA)")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError("--device", f"{spec}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device", "mps: this machine has no Apple GPU available to torch")
    return device


def available_memory(device: torch.device) -> int:
    """Bytes this peer can still allocate on ``device``: free GPU memory, or the system's available memory for cpu."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    return _system_available_memory()


def peak_gpu_memory() -> dict[str, float]:
    """For a metrics record: ``peak_gpu_mb``, the most memory this process has held in CUDA tensors so far
    (``torch.cuda.max_memory_allocated``, over its GPUs); empty while it has not used CUDA."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # torch.cuda.is_initialized has no annotations
        return {}
    peak = sum(torch.cuda.max_memory_allocated(index) for index in range(torch.cuda.device_count()))
    return {"peak_gpu_mb": round(peak / 2**20, 1)}


def _system_available_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:  # MemAvailable counts reclaimable cache, unlike free pages
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def compute_precision(device: torch.device, precision: Precision) -> Iterator[None]:
    """Forward and backward of ``precision`` on ``device``: bf16 autocast, or plain fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        yield


def describe(device: torch.device) -> str:
    """The device as a peer's log and the dashboard name it (``cuda:0 (NVIDIA H100)``, ``cpu``)."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
