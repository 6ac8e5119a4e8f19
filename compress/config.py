"""Which codecs a swarm uses on the wire (part of the swarm config)."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATION_CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "subspace", "subspace+int8", "subspace+int4")
PSEUDO_GRADIENT_CODECS = ("fp32", "fp16", "bf16", "sparseloco")


@dataclass(kw_only=True)
class CodecConfig:
    activations: str = "int8"  # forward activations between stages
    gradients: str = "int8"  # activation-gradients on the way back
    pseudo_gradients: str = "sparseloco"  # outer-step exchange (sparseloco needs outer.method = sparseloco)
    topk: int = 64  # SparseLoCo: values kept per chunk
    chunk_size: int = 4096  # SparseLoCo: elements per chunk (2-D tensors as 64×64 tiles)
    error_decay: float = 0.95  # SparseLoCo: β of the error-feedback buffer

    def __post_init__(self) -> None:
        for name in ("activations", "gradients"):
            if getattr(self, name) not in ACTIVATION_CODECS:
                raise ValueError(f"config field '{name}': unknown codec {getattr(self, name)!r}; choose from {', '.join(ACTIVATION_CODECS)}")
        if self.pseudo_gradients not in PSEUDO_GRADIENT_CODECS:
            raise ValueError(f"config field 'pseudo_gradients': unknown codec {self.pseudo_gradients!r}; choose from {', '.join(PSEUDO_GRADIENT_CODECS)}")
        if self.chunk_size != 4096:
            raise ValueError("config field 'chunk_size': only 4096 (64×64 tiles) is supported")
        if not 1 <= self.topk <= self.chunk_size:
            raise ValueError(f"config field 'topk': must be in [1, {self.chunk_size}], got {self.topk}")
        if not 0.0 <= self.error_decay <= 1.0:
            raise ValueError(f"config field 'error_decay': must be in [0, 1], got {self.error_decay}")
