"""TEMPORARY (issue 35): the stage state moved to ``swarm/outer/state.py``; swarm/node/ still imports it from here."""

from swarm.outer.state import StageState, stream_state, weights_hash  # TEMPORARY: swarm/node/ imports these from here
from swarm.rpc.blobs import TransferError  # TEMPORARY: swarm/node/ imports it from here (its home: swarm.rpc.blobs)

__all__ = ["StageState", "TransferError", "stream_state", "weights_hash"]
