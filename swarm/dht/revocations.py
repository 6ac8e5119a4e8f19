"""Revocations that reach running peers: a private swarm's peers follow the newest signed revocation list.

``RevocationFollower`` checks the ``--revocations`` file and the lists peers republish in the DHT every
``period_s``, adopts a newer list the authority signed for this swarm, and republishes the newest it holds.
Why forged or stale lists change nothing: docs/architecture.md, dht/.

    >>> await RevocationFollower(membership, credentials, on_log=sink, period_s=5.0).sync()  # run(): every period_s
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from hivemind.dht import DHT
from hivemind.dht.node import DHTNode

from swarm.dht.membership import Membership
from swarm.events import EventSink, Revocations
from swarm.rpc.admission import Credentials
from swarm.rpc.auth import CertificateAuthorizer, CredentialError

logger = logging.getLogger(__name__)


class RevocationFollower:
    """Keeps a private-swarm peer's revocation list the newest the authority signed that it can find."""

    def __init__(self, membership: Membership, credentials: Credentials, *, on_log: EventSink, period_s: float) -> None:
        self.membership, self.credentials, self.on_log, self.period_s = membership, credentials, on_log, period_s
        self.verifier = credentials.verifier
        self.signed: bytes | None = credentials.revocations_bytes()  # adopted at start (load_credentials checked it)
        self._file = self.signed  # the file's content when last read: only a change is checked again

    async def run(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception as e:  # a DHT hiccup: the next period tries again
                logger.warning(f"revocation list sync failed: {e!r}")
            await asyncio.sleep(self.period_s)

    async def sync(self) -> None:
        """Adopt the newest valid list from the file and the DHT, then republish the one held."""
        for source, signed in [
            *self._file_if_changed(),
            *[("dht", s) for s in await self.membership.revocation_lists()],
        ]:
            await self._consider(source, signed)
        if self.signed is not None:
            await self.membership.publish_revocations(self.signed)

    def _file_if_changed(self) -> list[tuple[str, bytes]]:
        try:
            current = self.credentials.revocations_bytes()
        except CredentialError as e:  # removed while running: keep what we hold
            logger.warning(f"revocation list: {e}")
            return []
        changed, self._file = current != self._file, current
        return [("file", current)] if changed and current is not None else []

    async def _consider(self, source: str, signed: bytes) -> None:
        try:
            adopted = self.verifier.update_revocations(signed)
        except CredentialError as e:  # forged, or another swarm's: a peer of the DHT may publish anything
            (logger.warning if source == "file" else logger.debug)(f"revocation list from {source} refused: {e}")
            return
        if not adopted:
            return
        self.signed = signed
        await self.membership.dht.run_coroutine(partial(_update_dht_authorizer, signed=signed), return_future=True)
        listing = self.verifier.revocations
        logger.info(f"adopted revocation list #{listing.sequence} ({len(listing.revoked)} peers) from the {source}")
        self.on_log(Revocations(sequence=listing.sequence, revoked=len(listing.revoked), source=source))


async def _update_dht_authorizer(_dht: DHT, node: DHTNode, *, signed: bytes) -> bool:
    """In the DHT process: hand the list to the authorizer that admits DHT requests (its own verifier copy)."""
    authorizer = node.protocol.authorizer
    return authorizer.update_revocations(signed) if isinstance(authorizer, CertificateAuthorizer) else False
