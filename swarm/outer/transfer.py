"""A stage's state: the archive a live replica serves and a newcomer or straggler adopts, its checks and its download.

A stage's state is what a replica needs to take part from the next round on: the global weights,
the outer optimizer's state, the round number and the inner step count on the lr schedule. It
travels as a ``torch.save`` archive read back with ``weights_only=True`` (no code runs on load),
and every tensor is checked against the receiver's own stage (names, shapes, finite values).
It moves between peers as a named blob (``swarm/rpc/blobs.py``): ``state/<stage>`` (the last outer
round's, with the outer optimizer) and ``local/<stage>`` (a replica's current local weights, which
a stage rebuild ``swarm/recovery/rebuild.py`` and ``swarmloco export`` download).

    >>> blobs = BlobServicer(); blobs.provide("state", lambda name: replica.export_state())
    >>> await blobs.add_p2p_handlers(p2p, namespace=cfg.swarm_id)
    >>> fetch = functools.partial(BlobClient(p2p, namespace=cfg.swarm_id).fetch, timeout=30, max_bytes=state_bytes_bound(params))
    >>> peer, state = await download_state(fetch, candidates, stage=2, template=params)
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarm.rpc.blobs import TransferError

logger = logging.getLogger(__name__)

STATE_FORMAT = "swarmloco-stage-state-v1"
Fetch = Callable[[str, str], Awaitable[bytes]]  # (peer, blob name) → the verified blob, or TransferError


@dataclass(frozen=True, kw_only=True)
class StageState:
    """One stage's shared state: what a replica adopts to take part from round ``round`` on."""

    stage: int
    round: int  # outer rounds completed
    schedule_step: int  # inner steps on the lr schedule
    params: dict[str, torch.Tensor]  # the global weights (the local ones when the swarm has no outer step)
    optimizer: dict[str, Any] | None  # the outer optimizer's torch state_dict; None without an outer step


def weights_hash(params: Mapping[str, torch.Tensor]) -> str:
    """16 hex digits identifying exact weights: equal on replicas that agree, bit for bit."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode() + b"\0")
        h.update(params[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def pack_state(state: StageState) -> bytes:
    buffer = io.BytesIO()
    torch.save(
        {
            "format": STATE_FORMAT,
            "stage": state.stage,
            "round": state.round,
            "schedule_step": state.schedule_step,
            "params": state.params,
            "optimizer": state.optimizer,
        },
        buffer,
    )
    return buffer.getvalue()


def state_bytes_bound(template: Mapping[str, torch.Tensor]) -> int:
    """The largest state archive accepted for a stage: weights + one momentum buffer in fp32, and slack."""
    return 2 * 4 * sum(t.numel() for t in template.values()) + (4 << 20)


def unpack_state(data: bytes, *, stage: int, template: Mapping[str, torch.Tensor]) -> StageState:
    """Read and check a state archive against this stage's own parameters; ValueError if it does not fit."""
    try:
        blob = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for foreign or corrupt archives
        raise ValueError(f"unreadable state archive: {type(e).__name__}: {e}") from None
    if not isinstance(blob, dict) or blob.get("format") != STATE_FORMAT:
        raise ValueError(f"not a {STATE_FORMAT} archive")
    if blob.get("stage") != stage:
        raise ValueError(f"state of stage {blob.get('stage')!r}, expected {stage}")
    counters = [blob.get("round"), blob.get("schedule_step")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counters):
        raise ValueError(f"round and schedule_step must be non-negative integers, got {counters}")
    params = blob.get("params")
    if not isinstance(params, dict) or list(params) != list(template):
        raise ValueError("the state's parameter names differ from this stage's")
    for name, value in params.items():
        _check_tensor(name, value, template[name].shape)
    optimizer = blob.get("optimizer")
    if optimizer is not None:
        slots = optimizer.get("state") if isinstance(optimizer, dict) else None
        if not isinstance(slots, dict) or not isinstance(optimizer.get("param_groups"), list):
            raise ValueError("the outer optimizer state is not a torch optimizer state_dict")
        shapes = [t.shape for t in template.values()]
        for index, slot in slots.items():
            if not (isinstance(index, int) and 0 <= index < len(shapes) and isinstance(slot, dict)):
                raise ValueError(f"outer optimizer state for parameter {index!r}: not one of this stage's")
            for key, value in slot.items():
                if value is not None:  # SGD without momentum keeps None buffers
                    _check_tensor(f"outer optimizer {key} of parameter {index}", value, shapes[index])
    return StageState(
        stage=stage, round=blob["round"], schedule_step=blob["schedule_step"], params=params, optimizer=optimizer
    )


def _check_tensor(name: str, value: Any, shape: torch.Size) -> None:
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.shape == shape):
        raise ValueError(f"{name}: expected a float32 tensor of shape {tuple(shape)}")
    if not torch.isfinite(value).all():
        raise ValueError(f"{name}: non-finite values")


async def download_state(
    fetch: Fetch, peers: Sequence[str], *, stage: int, template: Mapping[str, torch.Tensor], blob: str = "state"
) -> tuple[str, StageState]:
    """The state of ``stage`` from the first of ``peers`` that delivers a valid one (each tried once, in order).

    ``blob``: ``state`` (the last outer round's, with the outer optimizer) or ``local`` (the replica's current weights).

    ``fetch(peer, name)`` returns a whole, hash-checked blob or raises ``TransferError``; a blob
    that arrives whole but does not fit the stage counts as a failed transfer too.
    """
    failures = []
    for peer in peers:
        try:
            return peer, unpack_state(await fetch(peer, f"{blob}/{stage}"), stage=stage, template=template)
        except (TransferError, ValueError) as e:
            logger.warning(f"state of stage {stage} from {peer}: {e}; trying another replica")
            failures.append(f"{peer}: {e}")
    raise TransferError(
        f"no replica of stage {stage} delivered its state ({'; '.join(failures) or 'no replica to ask'})"
    )
