"""What a stage server keeps between a forward and its backward: each forward's input (and graph, while the budget
allows) by owner (``ActivationCache``), and copies of the weights those forwards ran on (``WeightStash``), so a
backward recomputes on them after the server stepped.

    >>> cache.put(owner, mb, CacheEntry(x=x, tokens=None, forward_s=0.01, weights=0, inner_step=7), at=(0, 7))
    >>> entry = cache.pop(owner, mb)  # None: evicted (the trainer resends the input)
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from swarm.pipeline.graphs import KeptGraph

STASHED_STEPS = 2  # weight copies a server keeps for backwards whose forward ran before its last inner steps


@dataclass
class CacheEntry:
    x: torch.Tensor  # the decoded forward input, (B, T, d)
    tokens: torch.Tensor | None  # token ids the frame carried (subspace codecs), (B, T)
    forward_s: float  # compute time of the forward, counted into the throughput at backward
    weights: int  # the server's weights epoch the forward ran on (``StageServer.weights_epoch``)
    inner_step: int | None = None  # the server's inner steps when the forward ran; None: unknown (a resent input)
    graph: KeptGraph | None = None  # the forward's graph, kept for the backward (else it recomputes from ``x``)
    no_graph: str = "budget"  # else why not, its backward's ``graph_<why>_recompute``: budget, step_due or moved


WeightsAt = tuple[int, int]  # (weights epoch, inner steps): which weights a forward ran on
WeightCopy = dict[str, torch.Tensor]  # a stage's trainable weights by name


class WeightStash:
    """Copies of a stage's trainable weights from before its last ``keep`` moves, by the (epoch, step) they had.

    A backward recomputes its forward from the cached input. If inner steps (other microbatches' samples) or an outer
    round's install moved the weights in between, the recompute would differentiate weights the forward's output never
    came from; with the copy the backward differentiates the weights its forward ran on, and the gradient goes into
    the current weights (PipeDream's weight stashing). A copy is taken only when a forward on the current weights
    waits for its backward; a backward older than ``keep`` moves is recomputed on the current weights and counted
    (``stale_recompute``). Memory: up to ``keep`` fp32 copies of the stage's weights (``swarm/model/sizing.py``).

        >>> stash = WeightStash(keep=2); inner.before_step.append(lambda step: stash.take((epoch, step), module))
        >>> stash.get((entry.weights, entry.inner_step))  # the weights that forward ran on, or None
    """

    def __init__(self, *, keep: int = 2) -> None:
        self.keep = keep
        self._copies: OrderedDict[WeightsAt, WeightCopy] = OrderedDict()

    def take(self, at: WeightsAt, module: torch.nn.Module) -> None:
        """Copy ``module``'s trainable weights as they are at ``at`` (about to move), into the oldest copy's tensors
        once ``keep`` are held (a server stashes before every inner step: no allocation per step)."""
        reuse = (
            self._copies.popitem(last=False)[1] if len(self._copies) >= self.keep and at not in self._copies else None
        )
        with torch.no_grad():
            trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
            if reuse is not None and all(name in reuse and reuse[name].shape == p.shape for name, p in trainable):
                for name, p in trainable:
                    reuse[name].copy_(p.detach())
                self._copies[at] = reuse
            else:
                self._copies[at] = {name: p.detach().clone() for name, p in trainable}
        self._copies.move_to_end(at)
        while len(self._copies) > self.keep:
            self._copies.popitem(last=False)

    def get(self, at: WeightsAt | None) -> WeightCopy | None:
        return None if at is None else self._copies.get(at)

    def clear(self) -> None:
        self._copies.clear()

    def __len__(self) -> int:
        return len(self._copies)


class ActivationCache:
    """Forward inputs awaiting their backward, by owner (the calling peer) and key (its microbatch id), and the forward
    graphs kept with some of them.

    An owner holds at most ``1 / share`` of the cache's items and input bytes: one over it loses its own
    oldest entries. When the whole cache is full, the owner holding the most bytes (graphs included) loses its
    oldest: forwards never followed by a backward (a flood, from one peer or a few) evict the
    flooders' inputs, not those of peers that keep less. Kept graphs have a budget of their own, ``max_graph_bytes``
    (their loss costs a recompute, not a resend): over it, the owner holding the most graph bytes loses its oldest
    graph, its input staying; so an owner may take a graph's room from one that holds more (``admits_graph``), and a
    lone trainer gets the whole budget. An entry evicted or popped takes its graph with it.
    """

    def __init__(self, *, max_items: int, max_bytes: int, share: int = 4, max_graph_bytes: int = 0) -> None:
        self.max_items, self.max_bytes, self.max_graph_bytes = max_items, max_bytes, max_graph_bytes
        self.max_items_per_owner, self.max_bytes_per_owner = max(1, max_items // share), max_bytes // share
        self._owners: dict[Hashable, OrderedDict[Hashable, CacheEntry]] = {}  # owner → its entries, oldest first
        self._owner_bytes: Counter[Hashable] = Counter()  # inputs and graphs
        self._owner_graph_bytes: Counter[Hashable] = Counter()
        self.nbytes = self.graph_bytes = 0  # all, and the graphs' part
        self.evicted = self.graphs_released = 0

    def __len__(self) -> int:
        return sum(map(len, self._owners.values()))

    def put(self, owner: Hashable, key: Hashable, entry: CacheEntry, *, at: WeightsAt | None = None) -> None:
        """Cache ``entry``; with ``at`` (the weights now) first drop the graphs void there (``release_void_graphs``)."""
        if at is not None:
            self.release_void_graphs(at)
        self.pop(owner, key)
        self._owners.setdefault(owner, OrderedDict())[key] = entry
        self._count(owner, entry, 1)
        entries = self._owners[owner]
        while len(entries) > self.max_items_per_owner or self._input_bytes(owner) > self.max_bytes_per_owner:
            self._evict(owner)
        while len(self) > self.max_items or self.nbytes - self.graph_bytes > self.max_bytes:
            self._evict(max(self._owner_bytes, key=self._owner_bytes.__getitem__))
        while self.graph_bytes > self.max_graph_bytes:
            biggest = max(self._owner_graph_bytes, key=self._owner_graph_bytes.__getitem__)
            self.release_graph(biggest, next(e for e in self._owners[biggest].values() if e.graph is not None))

    def pop(self, owner: Hashable, key: Hashable) -> CacheEntry | None:
        entries = self._owners.get(owner)
        entry = None if entries is None else entries.pop(key, None)
        if entry is not None:
            self._count(owner, entry, -1)
        return entry

    def why_no_graph(self, owner: Hashable, nbytes: int | None, due_in: int) -> str | None:
        """Why a forward of ``owner`` would keep no graph of ``nbytes``, or None: "step_due" (the backwards of the
        forwards cached before it bring the ``due_in`` samples of an inner step, which updates the weights in place
        before its backward: the graph would be void) or "budget" (``admits_graph``)."""
        if self.samples >= due_in:
            return "step_due"
        return None if self.admits_graph(owner, nbytes) else "budget"

    def admits_graph(self, owner: Hashable, nbytes: int | None) -> bool:
        """Whether ``owner`` may keep a new graph of ``nbytes``: in the budget's free part, or in the room an owner
        holding more graph bytes than ``owner`` would then have would yield (``put`` releases its oldest). None (not
        yet known): with any budget, yes (the graph is then measured, and released at once if over)."""
        if nbytes is None or self.max_graph_bytes <= 0:
            return self.max_graph_bytes > 0
        if self.graph_bytes + nbytes <= self.max_graph_bytes:
            return True
        most = max(self._owner_graph_bytes.values(), default=0)
        return nbytes <= self.max_graph_bytes and self._owner_graph_bytes[owner] + nbytes <= most

    def release_graph(self, owner: Hashable, entry: CacheEntry, why: str = "budget") -> None:
        """Drop ``entry``'s kept graph (its memory goes with it); its input stays, and its backward recomputes."""
        self._count(owner, entry, -1)
        entry.graph, entry.no_graph = None, why
        self._count(owner, entry, 1)
        self.graphs_released += 1

    def release_void_graphs(self, at: WeightsAt) -> None:
        """Drop the graphs of forwards that ran on other weights than ``at``: the weights they saved were updated in
        place since (an inner step, an install), so none could be used. On the event loop, as every change here."""
        for owner, entries in list(self._owners.items()):
            for entry in entries.values():
                if entry.graph is not None and (entry.weights, entry.inner_step) != at:
                    self.release_graph(owner, entry, "moved")

    @property
    def samples(self) -> int:
        """Samples whose backward is awaited."""
        return sum(entry.x.shape[0] for entries in self._owners.values() for entry in entries.values())

    def graph_info(self) -> dict[str, float]:
        """For the server's record: the kept graphs' MiB, the budget's, and the graphs released (over it, or voided)."""
        mb, budget_mb = self.graph_bytes / 2**20, self.max_graph_bytes / 2**20
        return {"mb": mb, "budget_mb": budget_mb, "released": self.graphs_released}

    def _evict(self, owner: Hashable) -> None:
        _, old = self._owners[owner].popitem(last=False)
        self._count(owner, old, -1)
        old.graph = None  # freed now, whoever still holds the entry
        self.evicted += 1

    def _input_bytes(self, owner: Hashable) -> int:
        return self._owner_bytes[owner] - self._owner_graph_bytes[owner]

    def _count(self, owner: Hashable, entry: CacheEntry, sign: int) -> None:
        graph = sign * (0 if entry.graph is None else entry.graph.nbytes)
        self.nbytes += sign * self._size(entry) + graph
        self._owner_bytes[owner] += sign * self._size(entry) + graph
        self.graph_bytes += graph
        self._owner_graph_bytes[owner] += graph
        if not self._owners[owner]:  # forget owners with nothing cached: the table stays as small as the cache
            del self._owners[owner], self._owner_bytes[owner], self._owner_graph_bytes[owner]

    @staticmethod
    def _size(entry: CacheEntry) -> int:
        """The entry's input bytes (its graph's apart)."""
        tokens = 0 if entry.tokens is None else entry.tokens.nbytes
        return entry.x.nbytes + tokens
