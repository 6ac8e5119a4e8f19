"""Downloading a stage's state: from the first replica that delivers one that passes its claim's check.

A state streams straight into a ``StateDecoder`` (checked as it arrives, hash-checked when whole); a holder that
serves a state its claim does not bear out is blamed, and the next holder asked. One that served a round its
record does not claim yet (``RecordBehind``) is not blamed, and its state is kept (``NoStateDelivered.ahead``)
until the records, read again, vouch for it: then it is adopted without a second download (a 0.5 GB state is a
round old on arrival when rounds come every few seconds, and a joiner downloading again and again never met one).

    >>> claim, peer, state = await download_for_newcomer(fetch, newcomer_claims(claims), model=cfg.model, num_stages=3, stage=2)
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

import torch

from swarm.model.stages import seeded_norms, stage_shapes
from swarm.model.transformer import ModelConfig
from swarm.outer.claims import (
    LONE_CLAIM_MAX_NORM_RATIO,
    RecordBehind,
    Reference,
    StateCheck,
    StateClaim,
    newcomer_acceptance,
)
from swarm.outer.state import StageState, StateDecoder, state_bytes_bound
from swarm.rpc.blobs import Sink, StreamCut, TransferError

logger = logging.getLogger(__name__)

# (peer, blob name, sink) → the blob's SHA-256 once it has streamed into the sink whole, or TransferError
StreamFetch = Callable[[str, str, Sink], Awaitable[str]]
# the same with the largest blob accepted (a stage's ``state_bytes_bound``) as its fourth argument
SizedFetch = Callable[[str, str, Sink, int], Awaitable[str]]
Served = tuple[str, StageState]  # (the peer that served it, the state)


class NoStateDelivered(TransferError):
    """No holder delivered a state that passed its claim's check. ``ahead``: the latest state a holder served before
    its record claimed that round (``RecordBehind``), worth keeping until the records, read again, claim it."""

    def __init__(self, message: str, *, ahead: Served | None = None) -> None:
        super().__init__(message)
        self.ahead = ahead


def later(first: Served | None, second: Served | None) -> Served | None:
    """Of two states served ahead of their records, the later round's (either, if one is None)."""
    if first is None or second is None:
        return first or second
    return second if second[1].round > first[1].round else first


def claimed_ahead(claim: StateClaim, ahead: Served | None, check: StateCheck) -> Served | None:
    """``ahead``, a state kept from a holder that served it ahead of its record, if ``claim`` (from records read
    since) announces its round and it passes ``check`` (the claim's: vouched, exactly the announced weights, from
    whichever peer; else only from one of the claim's holders, since a lone claim's check leaves its hash unchecked)."""
    if ahead is None or ahead[1].round != claim.round or not (claim.vouched or ahead[0] in claim.holders):
        return None
    try:
        check(ahead[1])
    except ValueError:
        return None
    return ahead


async def download_state(
    fetch: StreamFetch,
    peers: Sequence[str],
    *,
    stage: int,
    template: Mapping[str, torch.Tensor],
    blob: str = "state",
    check: StateCheck = lambda state: None,
    blame: Callable[[str, str], None] = lambda peer, why: None,
) -> Served:
    """The state of ``stage`` from the first of ``peers`` that delivers a valid one (each tried once, in order).

    ``blob``: ``state`` (the last outer round's, with the outer optimizer) or ``local`` (the replica's current weights).

    ``fetch(peer, name, sink)`` streams a blob into ``sink`` (a ``StateDecoder``, which decodes it as it arrives)
    and returns once it is whole and hash-checked, or raises ``TransferError``; a stream that does not fit the
    stage (refused as it arrives), or a state that ``check`` refuses (``StateClaim.check``: not the claimed
    weights), counts as a failed transfer too, and ``blame(peer, why)`` hears of it: the peer sent it (but not of a
    ``RecordBehind``: a state newer than the holder's record is a lagging record, not a lie; the latest such state
    comes with the ``NoStateDelivered`` raised when no holder delivers, as its ``ahead``).
    """
    failures: list[str] = []
    ahead: Served | None = None
    for peer in peers:
        try:
            try:
                state = await _stream_state(fetch, peer, f"{blob}/{stage}", stage=stage, template=template)
                check(state)
            except RecordBehind:
                ahead = later(ahead, (peer, state))
                raise  # its record lags its state: try the next holder, blame nobody
            except ValueError as e:
                blame(peer, str(e))
                raise
            return peer, state
        except (TransferError, ValueError) as e:
            logger.warning(f"state of stage {stage} from {peer}: {e}; trying another replica")
            failures.append(f"{peer}: {e}")
    raise NoStateDelivered(
        f"no replica of stage {stage} delivered its state ({'; '.join(failures) or 'no replica to ask'})", ahead=ahead
    )


async def _stream_state(
    fetch: StreamFetch, peer: str, name: str, *, stage: int, template: Mapping[str, torch.Tensor]
) -> StageState:
    """Blob ``name`` from ``peer`` decoded as it streams; a stream cut short is asked for once more, into a fresh
    decoder, as ``BlobClient.fetch`` asks for a blob: on loopback a healthy replica's 200 KB state was seen to end
    part way (a rebuild then took the stage as lost, and copied a neighbour instead of merging)."""
    decoder = StateDecoder(stage=stage, template=template)
    try:
        await fetch(peer, name, decoder)
    except StreamCut as e:
        logger.info(f"{e}; asking {peer} again")
        decoder = StateDecoder(stage=stage, template=template)
        await fetch(peer, name, decoder)
    return decoder.result()


async def download_claimed(
    fetch: StreamFetch,
    claims: Sequence[StateClaim],
    *,
    stage: int,
    template: Mapping[str, torch.Tensor],
    check_for: Callable[[StateClaim], StateCheck],
    blob_for: Callable[[StateClaim], str] = lambda claim: "state",
    blame: Callable[[str, str], None] = lambda peer, why: None,
    ahead: Served | None = None,
) -> tuple[StateClaim, str, StageState]:
    """The first of ``claims`` (in order) that one of its holders fulfils: (claim, peer, state).

    Each claim's state is the ``blob_for(claim)`` blob of its holders, and must pass ``check_for(claim)``
    (``StateClaim.check`` or ``StateClaim.acceptance``); ``NoStateDelivered`` naming every failure if none delivers.
    ``ahead``: a state kept from an earlier try (``NoStateDelivered.ahead``), taken without a download for the claim
    that now announces it (``claimed_ahead``).
    """
    for claim in claims:
        if (kept := claimed_ahead(claim, ahead, check_for(claim))) is not None:
            return claim, *kept
    failures = []
    for claim in claims:
        try:
            peer, state = await download_state(
                fetch,
                claim.holders,
                stage=stage,
                template=template,
                blob=blob_for(claim),
                check=check_for(claim),
                blame=blame,
            )
            return claim, peer, state
        except NoStateDelivered as e:
            failures.append(str(e))
            ahead = later(ahead, e.ahead)
    raise NoStateDelivered("; ".join(failures) or f"no replica of stage {stage} claims a state", ahead=ahead)


async def download_claim(
    fetch: StreamFetch,
    claim: StateClaim,
    *,
    me: str,
    stage: int,
    template: Mapping[str, torch.Tensor],
    reference: Reference,
    also: StateCheck | None = None,
    blame: Callable[[str, str], None] = lambda peer, why: None,
    ahead: Served | None = None,
) -> Served:
    """A replica's catch-up: the state ``claim`` announces, from one of its holders but ``me``, held to the claim
    (vouched: exactly the claimed weights) and, vouched or not, within ``LONE_CLAIM_MAX_NORM_RATIO`` of
    ``reference``, the replica's own global weights, and to ``also`` (``StateTrust``'s reach and distance);
    ``NoStateDelivered`` if none delivers it. ``ahead``: a state kept from an earlier try, taken without a download
    if ``claim`` now announces it (``claimed_ahead``)."""
    check = claim.acceptance(reference, max_norm_ratio=LONE_CLAIM_MAX_NORM_RATIO, also=also)
    if (kept := claimed_ahead(claim, ahead, check)) is not None:
        return kept
    return await download_state(
        fetch,
        [peer for peer in claim.holders if peer != me],
        stage=stage,
        template=template,
        blame=lambda peer, why: blame(peer, f"its state for round {claim.round}: {why}"),
        check=check,
    )


async def download_for_newcomer(
    fetch: SizedFetch,
    claims: Sequence[StateClaim],
    *,
    model: ModelConfig,
    num_stages: int,
    stage: int,
    blob_for: Callable[[StateClaim], str] = lambda claim: "state",
    blame: Callable[[str, str], None] = lambda peer, why: None,
    ahead: Served | None = None,
) -> tuple[StateClaim, str, StageState]:
    """``download_claimed`` for a peer that holds none of the stage's weights (a joiner, ``swarmloco export``).

    Nothing of the stage is drawn: the state decodes into its ``stage_shapes`` (meta tensors), and a lone claim is
    held to the seeded weights' norms (``seeded_norms``, within ``NEWCOMER_MAX_NORM_RATIO``).
    """
    template = stage_shapes(model, num_stages, stage)
    bound = state_bytes_bound(template)
    return await download_claimed(
        lambda peer, name, sink: fetch(peer, name, sink, bound),
        claims,
        stage=stage,
        template=template,
        check_for=newcomer_acceptance(seeded_norms(model, num_stages, stage)),
        blob_for=blob_for,
        blame=blame,
        ahead=ahead,
    )
