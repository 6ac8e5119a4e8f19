"""A stage's state: the archive a live replica serves and a newcomer or straggler adopts, its checks and its download.

A stage's state is what a replica needs to take part from the next round on: the global weights,
the outer optimizer's state, the round number and the inner step count on the lr schedule. It
travels as a ``torch.save`` archive read back with ``weights_only=True`` (no code runs on load),
and every tensor is checked against the receiver's own stage (names, shapes, finite values).

No single peer can make another adopt a state. Replicas announce the ``(outer_round, global_hash)``
they hold in their stage records (the hash every member of a round publishes after applying it),
and a state is downloaded only as the fulfilment of such a **claim**: its round and weights hash
must be the claimed ones. A claim is *vouched for* when two or more replicas announce it (the
downloader's own record counts). Whenever the stage has a vouched claim, unvouched ones are
ignored: a peer announcing a later round alone takes over nothing. Only a stage with no two
replicas in agreement (a lone replica, a pair split by a failed round) falls back to a lone
claim, and then only to weights whose per-tensor norms are close to the downloader's own (a
newcomer's: the seeded initial weights; ``check_plausible``): a lone liar cannot install scaled
or zeroed weights.

It moves between peers as a named blob (``swarm/rpc/blobs.py``): ``state/<stage>`` (the last outer
round's, with the outer optimizer) and ``local/<stage>`` (a replica's current local weights, which
a stage rebuild ``swarm/recovery/rebuild.py`` and ``swarmloco export`` download).

    >>> blobs = BlobServicer(); blobs.provide("state", lambda name: replica.export_state())
    >>> await blobs.add_p2p_handlers(p2p, namespace=cfg.swarm_id)
    >>> fetch = functools.partial(BlobClient(p2p, namespace=cfg.swarm_id).fetch, timeout=30, max_bytes=state_bytes_bound(params))
    >>> peer, state = await download_state(fetch, candidates, stage=2, template=params)
    >>> claims = catch_up_claims(stage_claims(others, me=(me, 7, own_hash)), round_=7, weights_hash=own_hash, me=me)
    >>> peer, state = await download_state(fetch, claims[0].holders, stage=2, template=params, check=claims[0].check)
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarm.dht.records import StageStatus
from swarm.rpc.blobs import TransferError

logger = logging.getLogger(__name__)

STATE_FORMAT = "swarmloco-stage-state-v1"
Fetch = Callable[[str, str], Awaitable[bytes]]  # (peer, blob name) → the verified blob, or TransferError
# A lone claim's weights may differ from a replica's own by at most this factor in any tensor's norm: an honest
# replica a few rounds ahead differs by a few percent, a liar's scaled (×1000) or zeroed weights by far more.
LONE_CLAIM_MAX_NORM_RATIO = 10.0
# A newcomer compares with the seeded initial weights, which training moves much further (yet not ×100).
NEWCOMER_MAX_NORM_RATIO = 100.0


@dataclass(frozen=True, kw_only=True)
class StageState:
    """One stage's shared state: what a replica adopts to take part from round ``round`` on."""

    stage: int
    round: int  # outer rounds completed
    schedule_step: int  # inner steps on the lr schedule
    params: dict[str, torch.Tensor]  # the global weights (the local ones when the swarm has no outer step)
    optimizer: dict[str, Any] | None  # the outer optimizer's torch state_dict; None without an outer step


StateCheck = Callable[[StageState], None]  # raises ValueError for a state the downloader must not adopt


@dataclass(frozen=True, kw_only=True)
class StateClaim:
    """Replicas announcing that they hold the global weights ``weights_hash`` after ``round`` outer rounds."""

    round: int
    weights_hash: str  # "" when the stage has no outer step (nothing to vouch for)
    holders: tuple[str, ...]  # peer ids, sorted; the downloader's own id when it holds this state too

    @property
    def vouched(self) -> bool:
        """Announced by more than one replica: no single peer's word."""
        return len(self.holders) >= 2 and bool(self.weights_hash)

    def check(self, state: StageState) -> None:
        """ValueError unless ``state`` is exactly the claimed one: its round, and weights that hash as announced."""
        if state.round != self.round:
            raise ValueError(f"served the state of round {state.round}, its record claims round {self.round}")
        if self.weights_hash and (served := weights_hash(state.params)) != self.weights_hash:
            raise ValueError(f"served weights hashing to {served}, its record claims {self.weights_hash}")

    def acceptance(self, reference: Mapping[str, torch.Tensor], *, max_norm_ratio: float) -> StateCheck:
        """What a state downloaded for this claim must pass: when vouched for, be exactly the claimed one (``check``);
        on one peer's word only, be of the claimed round or a later one (the peer may have done rounds since it
        announced; its word is all there is either way) and hold weights whose norms stay within
        ``max_norm_ratio`` of ``reference``'s (``check_plausible``)."""
        if self.vouched:
            return self.check

        def check(state: StageState) -> None:
            if state.round < self.round:
                raise ValueError(f"served the state of round {state.round}, its record claims round {self.round}")
            check_plausible(state.params, reference, max_norm_ratio=max_norm_ratio)

        return check


def stage_claims(others: Mapping[str, StageStatus], *, me: tuple[str, int, str] | None = None) -> list[StateClaim]:
    """The stage's claims from its replicas' records (``others``) and, as (peer id, round, hash), the downloader's own."""
    holders: dict[tuple[int, str], list[str]] = {}
    for peer, status in others.items():
        holders.setdefault((status.outer_round, status.global_hash), []).append(peer)
    if me is not None and me[2]:
        holders.setdefault((me[1], me[2]), []).append(me[0])
    return [StateClaim(round=r, weights_hash=h, holders=tuple(sorted(peers))) for (r, h), peers in holders.items()]


def newcomer_claims(claims: Sequence[StateClaim]) -> list[StateClaim]:
    """The claims a replica with no state of its own tries, best first: the vouched ones if the stage has any (latest
    round, then most holders), else the lone ones (latest round first)."""
    vouched = [c for c in claims if c.vouched]
    return sorted(vouched or claims, key=lambda c: (-c.round, -len(c.holders), c.holders))


def catch_up_claims(claims: Sequence[StateClaim], *, round_: int, weights_hash: str, me: str) -> list[StateClaim]:
    """The claims a replica at ``round_`` holding ``weights_hash`` should download, best first; empty: keep its own.

    It follows a claim to a later round, or one at its own round with other weights (a group split
    by a DHT race) that has more holders than its own, or as many and the smallest peer id. With a
    vouched claim anywhere in the stage (its own included), it follows only vouched claims.
    """
    own = StateClaim(round=round_, weights_hash=weights_hash, holders=(me,))
    own = next((c for c in claims if c.round == round_ and c.weights_hash == weights_hash and me in c.holders), own)

    def better(c: StateClaim) -> bool:
        if c.round != round_:
            return c.round > round_
        if not c.weights_hash or c.weights_hash == weights_hash:
            return False
        return (-len(c.holders), c.holders[0]) < (-len(own.holders), own.holders[0])

    ahead = [c for c in claims if better(c)]
    if any(c.vouched for c in claims):
        ahead = [c for c in ahead if c.vouched]
    return sorted(ahead, key=lambda c: (-c.round, -len(c.holders), c.holders))


def check_plausible(
    params: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], *, max_norm_ratio: float
) -> None:
    """ValueError if a tensor's norm differs from ``reference``'s by more than ``max_norm_ratio`` either way."""
    for name, value in params.items():
        norm, ref = float(value.double().norm()), float(reference[name].detach().double().norm())
        if ref > 0 and not ref / max_norm_ratio <= norm <= ref * max_norm_ratio:
            raise ValueError(
                f"{name}: norm {norm:.4g} against {ref:.4g} here, beyond ×{max_norm_ratio:g}: not a replica's weights"
            )


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
    fetch: Fetch,
    peers: Sequence[str],
    *,
    stage: int,
    template: Mapping[str, torch.Tensor],
    blob: str = "state",
    check: StateCheck = lambda state: None,
    blame: Callable[[str, str], None] = lambda peer, why: None,
) -> tuple[str, StageState]:
    """The state of ``stage`` from the first of ``peers`` that delivers a valid one (each tried once, in order).

    ``blob``: ``state`` (the last outer round's, with the outer optimizer) or ``local`` (the replica's current weights).

    ``fetch(peer, name)`` returns a whole, hash-checked blob or raises ``TransferError``; a blob
    that arrives whole but does not fit the stage, or that ``check`` refuses (``StateClaim.check``:
    not the claimed weights), counts as a failed transfer too, and ``blame(peer, why)`` hears of it:
    the peer sent it, whole and hash-checked.
    """
    failures = []
    for peer in peers:
        try:
            data = await fetch(peer, f"{blob}/{stage}")
            try:
                state = unpack_state(data, stage=stage, template=template)
                check(state)
            except ValueError as e:
                blame(peer, str(e))
                raise
            return peer, state
        except (TransferError, ValueError) as e:
            logger.warning(f"state of stage {stage} from {peer}: {e}; trying another replica")
            failures.append(f"{peer}: {e}")
    raise TransferError(
        f"no replica of stage {stage} delivered its state ({'; '.join(failures) or 'no replica to ask'})"
    )
