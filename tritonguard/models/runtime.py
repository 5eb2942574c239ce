"""The ``runtime`` Python-based backend: serve the artifact in a version folder.

One forward per ``execute()`` over the concatenated dynamic batch (one per distinct per-item
shape, e.g. token sequences of different lengths), split back per request.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import numpy as np

from tritonguard.core.config import from_params, model_parameters
from tritonguard.core.errors import TritonGuardError
from tritonguard.core.tensors import ModelSignature, concat, offsets, split
from tritonguard.models.engines import EngineConfig, load_engine
from tritonguard.triton import backend as triton

log = logging.getLogger(__name__)


def group_by_item_shape(inputs: list[dict[str, np.ndarray]]) -> dict[tuple, list[int]]:
    """Requests whose inputs share per-item shapes can be fused into one forward."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, ins in enumerate(inputs):
        groups[tuple((n, a.shape[1:]) for n, a in sorted(ins.items()))].append(i)
    return groups


def run_fused(engine, inputs: list[dict[str, np.ndarray]], input_names, output_names) -> list[dict[str, np.ndarray]]:
    """Run ``engine`` over all requests, fusing those with equal item shapes."""
    results: list[dict[str, np.ndarray] | None] = [None] * len(inputs)
    for idx in group_by_item_shape(inputs).values():
        starts = offsets([len(inputs[i][input_names[0]]) for i in idx])
        fused = {n: concat([inputs[i][n] for i in idx]) for n in input_names}
        out = engine.run(fused, output_names)
        parts = {n: split(out[n], starts) for n in output_names}
        for k, i in enumerate(idx):
            results[i] = {n: parts[n][k] for n in output_names}
    return results  # type: ignore[return-value]


class RuntimeModel:
    def initialize(self, args: dict[str, str]) -> None:
        a = triton.prologue(args)
        self.name = a.name
        self.signature = ModelSignature.from_config(a.config)
        self.engine_config = from_params(EngineConfig, model_parameters(a.config), model=self.name)
        self.input_names = [s.name for s in self.signature.inputs]
        self.output_names = [s.name for s in self.signature.outputs]
        self.engine = load_engine(a.version_dir, self.engine_config, self.input_names, self.output_names)
        log.info("runtime %s v%s serves %s", self.name, a.version, self.engine.path.name)

    def execute(self, requests: list[Any]) -> list[Any]:
        try:
            inputs = [triton.request_inputs(r, self.input_names) for r in requests]
            results = run_fused(self.engine, inputs, self.input_names, self.output_names)
            return [triton.response(r) for r in results]
        except TritonGuardError as exc:
            return [triton.error(exc) for _ in requests]
        except Exception as exc:  # noqa: BLE001 - never let a traceback reach clients
            log.exception("runtime %s: forward failed", self.name)
            return [triton.error(f"model '{self.name}' failed to run the batch: {type(exc).__name__}") for _ in requests]

    def finalize(self) -> None:
        self.engine = None
