"""A stage server's kept forward graphs: what one holds in memory, measured on the first ones, then predicted.

A server that keeps its forward's autograd graph until the backward saves the recompute (+1/3 of a stage's FLOPs)
at the cost of the graph's saved tensors; ``ActivationCache`` (``swarm/pipeline/server.py``) holds kept graphs with
the inputs, within a byte budget (``--keep-graph-mb``). More: docs/architecture.md, pipeline/.

    >>> graph = build_graph(module, x, x.to(device), sizer)  # graph.y: the output; graph.nbytes: what it holds
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType

import torch

from swarm.model.stages import MiddleStage
from swarm.model.step import stage_forward_graph

MEASURED_GRAPHS = 4  # graphs measured before the prediction is trusted: warm-up allocations differ from the rest
AUTO_BUDGET_FRACTION = 0.25  # of the device memory free at a server's start, when --keep-graph-mb is auto


@dataclass
class KeptGraph:
    """A forward's autograd graph, kept for its backward (``graph_gradients``)."""

    x: torch.Tensor  # the forward's input on the device, the graph's leaf (requires grad)
    y: torch.Tensor  # its output, with the graph back to ``x`` and the weights
    nbytes: int  # what its saved tensors hold beyond the weights and the cached input: measured, or predicted


class SavedBytes:
    """Bytes of the distinct storages autograd saves for the backward while it is entered, beyond ``exclude``'s (the
    weights, and the input the cache already counts): what a kept graph holds in memory.

    Storages, not tensors: views of one storage (a transpose, q/k/v split from one projection) are one allocation.
    """

    def __init__(self, *, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._storages: dict[tuple[str, int], int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._excluded:
            self._storages[key] = tensor.untyped_storage().nbytes()
        return tensor  # kept as it is: only counted

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._hooks.__exit__(kind, error, traceback)


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class GraphSizer:
    """Predicts a kept graph's bytes from its tokens, by the most bytes per token of the first ``measure`` graphs.

    The most, not the mean: a graph under-predicted goes over the budget (the cache then releases one). A graph's
    saved tensors grow with its tokens (flash attention's too: no T² score matrix is saved through SDPA).
    """

    def __init__(self, *, measure: int = MEASURED_GRAPHS) -> None:
        self.to_measure = measure
        self.bytes_per_token = 0.0

    @property
    def measuring(self) -> bool:
        return self.to_measure > 0

    def observe(self, *, tokens: int, nbytes: int) -> None:
        self.bytes_per_token = max(self.bytes_per_token, nbytes / max(tokens, 1))
        self.to_measure -= 1

    def predict(self, tokens: int) -> int | None:
        """Bytes of a graph of ``tokens``; None before the first measurement."""
        return None if self.bytes_per_token == 0.0 else int(self.bytes_per_token * tokens)


def build_graph(stage: MiddleStage, x: torch.Tensor, on_device: torch.Tensor, sizer: GraphSizer) -> KeptGraph:
    """``stage``'s forward of ``on_device`` (``x``, the cached input, moved there), keeping its graph, whose bytes
    ``sizer`` measures (its first few graphs) or predicts (the rest: the hooks then cost nothing)."""
    tokens = x.shape[0] * x.shape[1]
    if not sizer.measuring:
        leaf, y = stage_forward_graph(stage, on_device)
        return KeptGraph(x=leaf, y=y, nbytes=sizer.predict(tokens) or 0)
    with SavedBytes(exclude=[*stage.parameters(), x]) as saved:  # the weights are no graph's; the cache counts x
        leaf, y = stage_forward_graph(stage, on_device)
    sizer.observe(tokens=tokens, nbytes=saved.nbytes)
    return KeptGraph(x=leaf, y=y, nbytes=saved.nbytes)


def graph_budget_bytes(keep_graph_mb: int | None, available: int) -> int:
    """The bytes kept graphs may hold: ``keep_graph_mb`` MiB, or with None (auto) a quarter of ``available`` (the
    device memory free when the server starts, its stage built): the memory check (``check_fits``) reserved its weights,
    optimizer and one recompute's activations already, and a quarter leaves the rest to peers that share the device
    (a GPU lent to several servers and trainers) and to the allocator's slack. 0: always recompute."""
    if keep_graph_mb is None:
        return int(AUTO_BUDGET_FRACTION * available)
    return keep_graph_mb << 20
