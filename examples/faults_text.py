"""A seeded-fault candidate of ``minilm``: embeddings pulled towards one fixed direction.

Every embedding moves by 0.6 along a fixed unit vector before re-normalisation, so its cosine
with the true embedding drops to about 0.86: valid-looking, unit-norm, and wrong. Exported as
``--name minilm`` it becomes the next version; its own golden check passes (the reference is
this faulty model), so only the guard's canary comparison with the primary can catch it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from exporter.build.sources.spec import ExportSpec

from . import minilm

PULL = 0.6


class Pulled(nn.Module):
    def __init__(self, base: nn.Module, dim: int):
        super().__init__()
        self.base = base
        direction = torch.randn(dim, generator=torch.Generator().manual_seed(7))
        self.register_buffer("direction", direction / direction.norm())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        emb = self.base(input_ids, attention_mask) + PULL * self.direction
        return nn.functional.normalize(emb, p=2.0, dim=1)


def pulled() -> ExportSpec:
    spec = minilm.build()
    module = Pulled(spec.module, minilm.DIM).eval()
    true_reference = spec.reference

    def reference(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        emb = true_reference(inputs)["EMBEDDING"] + PULL * module.direction.numpy()
        return {"EMBEDDING": (emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float32)}

    return dataclasses.replace(spec, module=module, reference=reference)
