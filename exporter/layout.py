"""config.pbtxt contents for each model the exporter writes, as ModelConfig-shaped dicts.

Every dict goes through :func:`tritonguard.repository.write_config`, which parses it into
Triton's own ``ModelConfig`` protobuf, so a typo here fails the export, not the server load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tritonguard import repository
from tritonguard.tensors import NUMPY_TO_TRITON

from .sources import ExportSpec, TensorDef

# small models: waiting longer for a fuller batch costs more latency than it saves
RAW_QUEUE_DELAY_US = 500
# A text guard waits on a BLS call to the ensemble for milliseconds; requests queue meanwhile,
# so batches form without a delay window. Two instances keep two calls in flight, so the
# tokenizer and encoder stay pipelined as they are without a guard. Measured at c=16 on one
# server: 1 instance + 2 ms delay 0.93x raw; 2 instances + no delay 1.11x raw.
TEXT_GUARD_QUEUE_DELAY_US = 0
TEXT_GUARD_INSTANCES = 2
# 256 tokens are a few KB of text; 16 KiB bounds the tokenizer's work per element with margin
TEXT_MAX_BYTES_LENGTH = 16384
# the encoder dominates the text path's cost (~70 ms at batch 32 on 2 threads vs ~1 ms for
# the tokenizer), so it gets the second thread; the small raw models keep one per instance
ENCODER_THREADS = 2


def _tensor(t: TensorDef) -> dict[str, Any]:
    return {"name": t.name, "data_type": NUMPY_TO_TRITON[np.dtype(t.dtype)], "dims": list(t.dims)}


def _params(**kv: Any) -> dict[str, Any]:
    return {k: {"string_value": str(v)} for k, v in kv.items()}


def _common(max_batch: int, delay_us: int, instances: int = 1) -> dict[str, Any]:
    return {
        "max_batch_size": max_batch,
        "dynamic_batching": {"max_queue_delay_microseconds": delay_us},
        "instance_group": [{"kind": "KIND_CPU", "count": instances}],
    }


LATEST_ONLY = {"latest": {"num_versions": 1}}
# the parts of a text model: every version loaded, so each per-version ensemble can pin its own
ALL_VERSIONS: dict[str, Any] = {"all": {}}


def version_ensemble_name(raw: str, version: int) -> str:
    """``<name>_raw_v<N>``: the ensemble pinned to tokenizer N and encoder N, which the guard
    routes to by version (an ensemble's config cannot pin other steps per version)."""
    return f"{raw}_v{version}"


def runtime_config(name: str, spec: ExportSpec, *, threads: int = 1, native: bool = False) -> dict[str, Any]:
    """The artifact model, served by our ``runtime`` backend, or with ``native`` by Triton's own
    onnxruntime backend (the NGC image has it; the nvidia-pytriton binary does not)."""
    if native:
        return {
            "name": name, "platform": "onnxruntime_onnx", **_common(spec.max_batch_size, RAW_QUEUE_DELAY_US),
            "input": [_tensor(t) for t in spec.inputs], "output": [_tensor(t) for t in spec.outputs],
            "version_policy": LATEST_ONLY,
        }
    return {
        "name": name, "backend": "runtime", **_common(spec.max_batch_size, RAW_QUEUE_DELAY_US),
        "input": [_tensor(t) for t in spec.inputs], "output": [_tensor(t) for t in spec.outputs],
        "version_policy": LATEST_ONLY, "parameters": _params(intra_op_threads=threads),
    }


def tokenizer_config(name: str, spec: ExportSpec) -> dict[str, Any]:
    text = spec.text
    assert text is not None
    params = {"tokenizer_dir": "tokenizer", "max_length": text.max_length}
    if text.text_input != "TEXT":
        params["text_input"] = text.text_input
    return {
        "name": name, "backend": "tokenizer", **_common(spec.max_batch_size, RAW_QUEUE_DELAY_US),
        "input": [_tensor(t) for t in spec.public_inputs],
        # the tokenizer emits exactly the encoder's inputs, by the same names
        "output": [_tensor(t) for t in spec.inputs],
        "version_policy": ALL_VERSIONS, "parameters": _params(**params),
    }


def ensemble_config(name: str, spec: ExportSpec, tokenizer: str, encoder: str, pin: int = -1) -> dict[str, Any]:
    """The ensemble tokenizer -> encoder; ``pin`` fixes both steps to one version (-1: latest)."""
    text = spec.text
    assert text is not None
    tok_outputs = {t.name: t.name for t in spec.inputs}
    return {
        "name": name, "platform": "ensemble", "max_batch_size": spec.max_batch_size,
        "input": [_tensor(t) for t in spec.public_inputs],
        "output": [_tensor(t) for t in spec.public_outputs],
        "version_policy": LATEST_ONLY,
        "ensemble_scheduling": {"step": [
            {"model_name": tokenizer, "model_version": pin,
             "input_map": {text.text_input: text.text_input},
             "output_map": tok_outputs},
            {"model_name": encoder, "model_version": pin, "input_map": tok_outputs,
             "output_map": {spec.outputs[0].name: text.public_output}},
        ]},
    }


def guard_config(name: str, spec: ExportSpec, target: str, *, placement: str) -> dict[str, Any]:
    """The public model: same IO and batch cap as its target, plus validation parameters."""
    params: dict[str, Any] = {"target": target, "placement": placement}
    if spec.text is not None:
        params["target_per_version"] = f"{target}_v{{version}}"
    for inp, (lo, hi) in spec.input_ranges.items():
        params[f"validation.range.{inp}"] = f"{lo:g},{hi:g}"
    if spec.text is not None:
        params["validation.max_bytes_length"] = TEXT_MAX_BYTES_LENGTH
        # PII is redacted before the text reaches the target, the cache key or the audit log
        params["redaction.model_sees_redacted"] = "true"
    text = spec.text is not None
    delay = TEXT_GUARD_QUEUE_DELAY_US if text else RAW_QUEUE_DELAY_US
    return {
        "name": name, "backend": "guard",
        **_common(spec.max_batch_size, delay, TEXT_GUARD_INSTANCES if text else 1),
        "input": [_tensor(t) for t in spec.public_inputs],
        # SERVED_BY: which target version answered each request (python_backend 24.10 has no
        # response parameters, so it travels as an output; clients may simply not request it)
        "output": [*(_tensor(t) for t in spec.public_outputs),
                   {"name": "SERVED_BY", "data_type": "TYPE_STRING", "dims": [1]}],
        "parameters": _params(**params),
    }


def write(model_dir: Path, config: dict[str, Any]) -> Path:
    return repository.write_config(model_dir, config)


def render(config: dict[str, Any]) -> str:
    """Validate without writing: used before anything touches the repository."""
    return repository.render_config(config)
