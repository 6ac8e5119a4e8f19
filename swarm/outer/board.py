"""What a peer offers its round groups: the payloads it holds and the commits it leads (the ``outer`` blobs).

A commit is the leader's (owner, SHA-256) list of the payloads a round applies, msgpack-encoded;
``parse_commit`` reads one and refuses one over ``MAX_COMMIT_BYTES`` before decoding it.

    >>> board.offer(key, me, payload); board.commit(key, [(me, digest(payload))]); await board.get(key.blob("commit"))
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable

import msgpack

from swarm.outer.group import RoundKey
from swarm.rpc.blobs import TransferError

_BLOB = re.compile(r"outer/(\d+)/(\d+)/(commit|payload/([\w.-]+))")
# A commit holds one (peer id, SHA-256) pair per contributor, about 90 bytes each whatever the model's size (a 1B
# stage's commit is as long as a tiny one's): 64 KiB holds a group of some 700 replicas.
MAX_COMMIT_BYTES = 1 << 16


def digest(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


class Board:
    """What this peer offers its groups: the payloads it holds and the commits it leads (the ``outer`` blob provider).

    Entries are dropped ``retention_s`` after they were first offered: by then every member has
    finished the round, one way or another.
    """

    def __init__(self, *, retention_s: float, clock: Callable[[], float]) -> None:
        self.retention_s, self.clock = retention_s, clock
        self._payloads: dict[RoundKey, dict[str, bytes]] = {}
        self._commits: dict[RoundKey, bytes | None] = {}  # None: this peer does not lead that round
        self._decided: dict[RoundKey, asyncio.Event] = {}
        self._offered_at: dict[RoundKey, float] = {}
        self._own_tries: dict[RoundKey, set[bytes]] = {}  # digests of this peer's own payloads per round, retries too

    def offer(self, key: RoundKey, owner: str, payload: bytes) -> None:
        self._forget_old()
        self._offered_at.setdefault(key, self.clock())
        self._payloads.setdefault(key, {})[owner] = payload

    def earlier_tries(self, key: RoundKey, mine: bytes) -> set[bytes]:
        """Record ``mine``, the digest of this peer's payload for ``key``; returns those of its payloads for ``key``
        before it (a replica that tries a round again makes a new payload each time)."""
        tries = self._own_tries.setdefault(key, set())
        earlier = tries - {mine}
        tries.add(mine)
        return earlier

    def commit(self, key: RoundKey, entries: list[tuple[str, bytes]] | None) -> None:
        """Publish the agreed (owner, digest) list of a round this peer leads; None: it does not lead it."""
        self._commits[key] = (
            None if entries is None else msgpack.packb([[owner, d] for owner, d in entries], use_bin_type=True)
        )
        self._event(key).set()

    async def get(self, name: str) -> bytes:
        """A blob named ``outer/<stage>/<round>/(commit|payload/<owner>)``; a commit is waited for until decided."""
        match = _BLOB.fullmatch(name)
        if match is None:
            raise LookupError(f"not an outer-round blob: {name!r}")
        key = RoundKey(int(match[1]), int(match[2]))
        if key not in self._offered_at:  # this peer takes no part in that round: nothing to wait for
            raise LookupError(f"no part in {key}")
        if match[4] is not None:
            payload = self._payloads.get(key, {}).get(match[4])
            if payload is None:
                raise LookupError(f"no payload of {match[4]} for {key}")
            return payload
        await self._event(key).wait()  # bounded by the blob service
        commit = self._commits.get(key)
        if commit is None:
            raise LookupError(f"this peer does not lead {key}")
        return commit

    def _event(self, key: RoundKey) -> asyncio.Event:
        return self._decided.setdefault(key, asyncio.Event())

    def _forget_old(self) -> None:
        for key in [k for k, t in self._offered_at.items() if self.clock() - t > self.retention_s]:
            for table in (self._payloads, self._commits, self._decided, self._offered_at, self._own_tries):
                table.pop(key, None)


def parse_commit(data: bytes) -> list[tuple[str, bytes]]:
    """The leader's (owner, digest) list; TransferError if over ``MAX_COMMIT_BYTES`` or malformed."""
    if len(data) > MAX_COMMIT_BYTES:
        raise TransferError(f"a commit of {len(data)} bytes is over the bound of {MAX_COMMIT_BYTES} bytes")
    try:
        entries = msgpack.unpackb(data, raw=False, max_bin_len=64, max_str_len=256)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise TransferError(f"unreadable commit: {e}") from None
    ok = (
        isinstance(entries, list)
        and entries
        and all(
            isinstance(e, list)
            and len(e) == 2
            and isinstance(e[0], str)
            and isinstance(e[1], bytes)
            and len(e[1]) == 32
            for e in entries
        )
    )
    if not ok or len({e[0] for e in entries}) != len(entries):
        raise TransferError("malformed commit: expected distinct [owner, sha256] pairs")
    return [(owner, d) for owner, d in entries]
