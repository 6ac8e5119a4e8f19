"""``SwarmDHT``: hivemind's DHT process, with the identity key this peer signs its records with.

The key is the libp2p identity's own (``swarm/dht/identity.py``): a record signed with it names
the peer id that ``dht.peer_id`` is, and no other. The node checks signatures and that binding on
every record from its start (records stored before a validator is added are never checked again).
A DHT started without an identity file gets a fresh one for the start of its daemon only.

    >>> dht = SwarmDHT(initial_peers=[...], host_maddrs=["/ip4/0.0.0.0/tcp/0"])   # started, as DHT(start=True)
    >>> Membership(dht)                                                            # signs with dht.identity
"""

from __future__ import annotations

from typing import Any

from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator

from swarm.dht.identity import (
    IdentityKey,
    OwnerBindingValidator,
    identity_file,
    identity_peer_id,
    load_identity_key,
)


class SwarmDHT(DHT):
    """A started hivemind DHT whose ``identity`` is the private key of its peer id."""

    identity: IdentityKey

    def __init__(self, *, identity_path: str | None = None, check_if_identity_free: bool = True, **kwargs: Any) -> None:
        with identity_file(identity_path) as (path, fresh):
            self.identity = load_identity_key(path)
            super().__init__(
                start=True,
                identity_path=str(path),
                # from the first record on: one stored before these were added would be served unchecked later
                record_validators=[RSASignatureValidator(self.identity), OwnerBindingValidator()],
                # a fresh identity is nobody's: asking the swarm would only cost a second daemon's start
                check_if_identity_free=check_if_identity_free and not fresh,
                **kwargs,
            )
        if identity_peer_id(self.identity) != self.peer_id.to_base58():  # hivemind changed how it reads identities
            self.shutdown()
            raise RuntimeError(
                f"the libp2p daemon runs peer id {self.peer_id}, not the one of {identity_path or 'its key'}"
            )
