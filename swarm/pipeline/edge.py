"""Stage 0's math as a trainer runs it on its edge thread: the embedding, the head's loss and gradients, and the
embedding's backward once a microbatch lands (``EdgeCompute``); ``PacedEdge`` waits a reference device's time and
gives recorded tensors instead (``--pace-as``, pacing.py). The trainer's loop is the same for both (trainer.py).

    >>> edge = EdgeCompute(build_stage(cfg.model, S, EDGE_STAGE), device=CPU, precision="fp32", inner_batch=16)
    >>> paced = PacedEdge(stage, pace=pace, device=CPU, precision="fp32", inner_batch=16)
    >>> h0 = edge.embed(inputs)                                    # (B, T) ids → (B, T, d), its graph kept
    >>> loss, grad, head_grads = edge.head_gradients(h, targets)   # grad: dLoss/dh, (B, T, d)
    >>> edge.backward(h0, grad_h0, head_grads)                     # into the edge stage's .grad
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from swarm.hardware import Precision, compute_precision
from swarm.model.stages import EDGE_STAGE, EdgeStage
from swarm.model.step import Gradients, add_gradients, embed, embed_backward, head_gradients
from swarm.model.transformer import loss_fn
from swarm.pipeline.pacing import Pace


class EdgeCompute:
    """The edge stage's own math (``swarm/model/step.py``), at the swarm's precision on ``device``."""

    def __init__(self, edge: EdgeStage, *, device: torch.device, precision: Precision, inner_batch: int) -> None:
        self.edge, self.device, self.precision, self.inner_batch = edge, device, precision, inner_batch

    def inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """The token ids a microbatch sends with its embedding (their codecs may code by token)."""
        return inputs

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        with self._precision():
            return embed(self.edge, inputs.to(self.device))  # (B, T, d), its graph kept for ``backward``

    @torch.no_grad()
    def embed_eval(self, inputs: torch.Tensor) -> torch.Tensor:
        with self._precision():
            h: torch.Tensor = self.edge.embed(inputs.to(self.device))
        return h

    def head_gradients(self, h: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor, Gradients]:
        """The loss, its gradient with respect to ``h`` and the head's gradients, held apart until the microbatch
        lands: an inner step taken meanwhile must not get half of its gradients."""
        with self._precision():
            return head_gradients(self.edge, h.to(self.device), targets.to(self.device), inner_batch=self.inner_batch)

    @torch.no_grad()
    def head_eval(self, h: torch.Tensor, targets: torch.Tensor) -> float:
        with self._precision():
            return loss_fn(self.edge.head(h.to(self.device)), targets.to(self.device)).item()

    def backward(self, h0: torch.Tensor, grad: torch.Tensor, head_grads: Gradients) -> None:
        """A landed microbatch's gradients into the edge stage's: its head's, and the embedding's from ``grad``."""
        add_gradients(self.edge, head_grads)
        with self._precision():
            embed_backward(h0, grad.to(self.device))

    def _precision(self) -> AbstractContextManager[None]:
        return compute_precision(self.device, self.precision)


class PacedEdge(EdgeCompute):
    """The edge stage at a reference device's pace: the embedding is a lookup (no time of its own), the head's forward
    and backward wait the device's time, every tensor is the recording's, and nothing accumulates (its weights never
    move, as a paced server's do not)."""

    def __init__(
        self, edge: EdgeStage, *, pace: Pace, device: torch.device, precision: Precision, inner_batch: int
    ) -> None:
        super().__init__(edge, device=device, precision=precision, inner_batch=inner_batch)
        self.pace = pace

    def inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.pace.tokens(inputs.shape[0])  # the recorded microbatch's: what its replayed embedding encodes

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.pace.output(0, inputs.shape[0])

    def embed_eval(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.pace.output(0, inputs.shape[0])

    def head_gradients(self, h: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor, Gradients]:
        self.pace.wait(self.pace.seconds[EDGE_STAGE], since=self.pace.clock())  # the head's forward and backward
        return self.pace.boundaries.loss, self.pace.output_gradient(targets.shape[0]), []

    def head_eval(self, h: torch.Tensor, targets: torch.Tensor) -> float:
        return self.pace.boundaries.loss

    def backward(self, h0: torch.Tensor, grad: torch.Tensor, head_grads: Gradients) -> None:
        pass  # no gradient to accumulate: the optimizer steps nothing
