"""config.pbtxt contents for each model the exporter writes, as ModelConfig-shaped dicts.

Every dict goes through :func:`tritonguard.core.repository.write_config`, which parses it into
Triton's own ``ModelConfig`` protobuf, so a typo here fails the export, not the server load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exporter.build.sources.spec import ExportSpec, TensorDef
from tritonguard.core import repository
from tritonguard.core.tensors import NUMPY_TO_TRITON

# small models: waiting longer for a fuller batch costs more latency than it saves
RAW_QUEUE_DELAY_US = 500
# A text guard runs the tokenizer -> encoder ensemble in process (configs.py; over BLS, its one
# instance idled through two more stub hops per batch while the encoder waited on its pre/post
# work). At c=16, one server, 2 alternating rounds, 2-core machine, 2026-11-27: one repeated
# sentence, in process 0.99x raw (BLS 0.85x) at 5.83 vs 5.97 ms server CPU per request (BLS
# 6.07 vs 5.70); c=1 1.16x raw (BLS 0.78x); 64 varied sentences 1.57x raw (BLS 1.20x).
# The call takes milliseconds and requests queue meanwhile, so batches form without a delay
# window. One instance (measured over BLS, 3 alternating rounds): behind the intake, every
# request that arrives during a call goes into the next one, so the encoder gets batches as
# large as the raw ensemble's; a second instance split them (5.7 rows instead of 8.0) and paid
# the per-batch Python twice: one repeated sentence, 1 instance: batch 8.4 vs raw 8.0, server
# CPU +0.37 ms/request over raw, guarded/raw 0.86; 2 instances: 5.7, +1.78 ms, 0.77. 64 varied
# sentences: 1 instance 10.2 ms CPU/request, 2 instances 10.9 (the raw ensemble's encoder gets
# 1.3-row batches there: different lengths do not batch). A queue delay buys batches at c=16
# and costs it at c=1 (8 ms: +14 ms p50 at c=1), so none (issue 33; the 2-instance default
# came from issue 13, before the intake existed).
TEXT_GUARD_QUEUE_DELAY_US = 0
TEXT_GUARD_INSTANCES = 1
# 256 tokens are a few KB of text; 16 KiB bounds the tokenizer's work per element with margin
TEXT_MAX_BYTES_LENGTH = 16384
# validation.max_payload_bytes = margin x the largest valid request (max_batch_size rows at full
# size), rounded up to whole KiB; BYTES elements count at validation.max_bytes_length each, plus
# Triton's 4-byte length prefix per element
PAYLOAD_MARGIN = 2
BYTES_ELEMENT_OVERHEAD = 4
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
# the parts of a text model: every version loaded, so each per-version ensemble can pin its own.
# A target the guard reaches over BLS too (``--native``, or a guard set to ``placement: bls``):
# the guard calls the version the routing names in Triton, and a rollout names two or more
# (primary, candidate, arms, the one a rollback returns to). With ``latest {num_versions: 1}``,
# `promote` loading v2 unloaded v1 and every stable request failed (issue 39 item 10). A
# runtime target behind an in-process guard keeps LATEST_ONLY: the guard runs its versions
# itself, and Triton's copy of each further version would only cost memory.
ALL_VERSIONS: dict[str, Any] = {"all": {}}


def target_version_policy(placement: str) -> dict[str, Any]:
    """The ``version_policy`` of a (non-text) target its guard reaches with ``placement``."""
    return ALL_VERSIONS if placement == "bls" else LATEST_ONLY


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
            "version_policy": target_version_policy("bls"),  # reached over BLS: every version a rollout names
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


def max_payload_bytes(spec: ExportSpec, max_bytes_length: int | None = None) -> int | None:
    """A ``validation.max_payload_bytes`` that every valid request fits: ``max_batch_size`` rows
    of every public input at full size (a BYTES element at ``max_bytes_length``, plus overhead),
    times :data:`PAYLOAD_MARGIN`, in whole KiB. None when an input has a dynamic dimension (no
    bound follows from the spec), or a BYTES input without a ``max_bytes_length``."""
    per_row = 0
    for t in spec.public_inputs:
        if any(d < 0 for d in t.dims):
            return None
        count = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
        if np.dtype(t.dtype) == np.dtype(object):
            if not max_bytes_length:
                return None
            per_row += count * (max_bytes_length + BYTES_ELEMENT_OVERHEAD)
        else:
            per_row += count * np.dtype(t.dtype).itemsize
    total = PAYLOAD_MARGIN * max(spec.max_batch_size, 1) * per_row
    return max(1024, -(-total // 1024) * 1024)


def guard_config(name: str, spec: ExportSpec, target: str, *, placement: str, serves_as: str = "") -> dict[str, Any]:
    """The guard: same IO and batch cap as its target, plus validation parameters. It is the
    public model itself, or with ``serves_as`` the guard step of the public ensemble of that
    name (:func:`front_config`)."""
    params: dict[str, Any] = {"target": target, "placement": placement}
    if serves_as:
        params["serves_as"] = serves_as
    if spec.text is not None:
        params["target_per_version"] = f"{target}_v{{version}}"
    for inp, (lo, hi) in spec.input_ranges.items():
        params[f"validation.range.{inp}"] = f"{lo:g},{hi:g}"
    if spec.text is not None:
        params["validation.max_bytes_length"] = TEXT_MAX_BYTES_LENGTH
        # PII is redacted before the text reaches the target, the cache key or the audit log
        params["redaction.model_sees_redacted"] = "true"
    # an explicit request size limit (the guard warns at load when there is none)
    payload = max_payload_bytes(spec, TEXT_MAX_BYTES_LENGTH if spec.text is not None else None)
    if payload is not None:
        params["validation.max_payload_bytes"] = payload
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


# the unbatched intake in front of a guard with BYTES inputs (tritonguard.models.intake): two
# instances, so one slow request (a large text being read) does not hold up the next
INTAKE_INSTANCES = 2


def needs_intake(config: dict[str, Any]) -> bool:
    """A guard with a BYTES input is served behind an intake: python_backend reads BYTES inputs
    for a whole batch before the guard runs, and one malformed one fails them all."""
    return any(t.get("data_type") == "TYPE_STRING" for t in config.get("input") or [])


def front_names(name: str) -> dict[str, str]:
    """``name`` is the public ensemble; these are its steps."""
    return {"intake": f"{name}_intake", "guard": f"{name}_guard"}


def intake_config(name: str, guard: dict[str, Any]) -> dict[str, Any]:
    """Hands the guard's inputs on one request at a time (no dynamic_batching on purpose)."""
    return {
        "name": name, "backend": "intake", "max_batch_size": guard.get("max_batch_size", 0),
        "input": [dict(t) for t in guard["input"]],
        "output": [{k: v for k, v in t.items() if k in ("name", "data_type", "dims")} for t in guard["input"]],
        "instance_group": [{"kind": "KIND_CPU", "count": INTAKE_INSTANCES}],
    }


def front_config(name: str, guard: dict[str, Any], intake: str, guard_name: str) -> dict[str, Any]:
    """The public model ``name``: the ensemble intake -> guard, with the guard's interface."""
    ins = [t["name"] for t in guard["input"]]
    outs = [t["name"] for t in guard["output"]]
    return {
        "name": name, "platform": "ensemble", "max_batch_size": guard.get("max_batch_size", 0),
        "input": [dict(t) for t in guard["input"]], "output": [dict(t) for t in guard["output"]],
        "ensemble_scheduling": {"step": [
            {"model_name": intake, "model_version": -1,
             "input_map": {n: n for n in ins}, "output_map": {n: f"{n}__intake" for n in ins}},
            {"model_name": guard_name, "model_version": -1,
             "input_map": {n: f"{n}__intake" for n in ins}, "output_map": {n: n for n in outs}},
        ]},
    }


def write(model_dir: Path, config: dict[str, Any]) -> Path:
    return repository.write_config(model_dir, config)


def render(config: dict[str, Any]) -> str:
    """Validate without writing: used before anything touches the repository."""
    return repository.render_config(config)


# -- keeping what the user set ------------------------------------------------------------------
# what the artifact and the spec fix: always the export's, whatever an existing config says
SIGNATURE_FIELDS = ("name", "input", "output", "max_batch_size", "backend", "platform")


@dataclass(frozen=True)
class Owned:
    """Top-level fields (besides :data:`SIGNATURE_FIELDS`) and parameter keys of one kind of
    model that the export writes whatever an existing config says: settings the exported
    version cannot be served correctly without."""

    fields: tuple[str, ...] = ()
    parameters: tuple[str, ...] = ()


RUNTIME_OWNS = Owned()
# which public name the guard serves under follows from the layout, not from a hand edit
GUARD_OWNS = Owned(parameters=("serves_as",))
# a batcher in front of the guard would bring back what the intake is there to prevent
INTAKE_OWNS = Owned(fields=("dynamic_batching", "sequence_batching"))
# every version stays loaded: each pinned ensemble <raw>_v<N> names its own
ENCODER_OWNS = Owned(fields=("version_policy",))
# the tokenizer must cut text as it was cut for the golden check
TOKENIZER_OWNS = Owned(fields=("version_policy",), parameters=("tokenizer_dir", "max_length", "text_input"))
ENSEMBLE_OWNS = Owned(fields=("ensemble_scheduling",))


def canonical(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as :func:`tritonguard.core.repository.read_config` returns a written one (64-bit
    integers as strings, defaults dropped), so an export's dict compares with a file's."""
    from google.protobuf import json_format  # noqa: PLC0415 - defers a heavy import
    from tritonclient.grpc import model_config_pb2  # noqa: PLC0415 - defers a heavy import

    msg = json_format.ParseDict(config, model_config_pb2.ModelConfig())
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def merge(existing: dict[str, Any] | None, computed: dict[str, Any], owned: Owned = Owned()) -> tuple[dict[str, Any], list[str]]:
    """The config to write over ``existing``: the export's ``computed`` one with the user's
    settings kept. Every existing top-level field and parameter key wins over the export's,
    except the signature and what ``owned`` names (a re-export must not silently undo an
    ``instance_group``, a ``validation.range.*``, a tenant quota). A field the existing config
    lacks gets the export's value. Returns the config and one notice per value that differed."""
    if existing is None:
        return computed, []
    old, new = canonical(existing), canonical(computed)
    merged, notices = dict(new), []
    for key, value in old.items():
        if key == "parameters":
            continue
        if key in SIGNATURE_FIELDS or key in owned.fields:
            if key != "name" and value != new.get(key):
                notices.append(f"set {key} {_short(new.get(key))} (was {_short(value)}; the export owns it)")
            continue
        if key in new and value != new[key]:
            notices.append(f"kept {key} {_short(value)} (export proposed {_short(new[key])})")
        merged[key] = value
    params = dict(new.get("parameters") or {})
    for key, value in (old.get("parameters") or {}).items():
        if key in owned.parameters:
            if value != params.get(key):
                notices.append(f"set {key}={_param(params.get(key))} (was {_param(value)}; the export owns it)")
            continue
        if key in params and value != params[key]:
            notices.append(f"kept {key}={_param(value)} (export proposed {_param(params[key])})")
        params[key] = value
    if params:
        merged["parameters"] = params
    return merged, notices


def _param(value: Any) -> str:
    return "(unset)" if value is None else str(value.get("string_value", "")) if isinstance(value, dict) else str(value)


def _short(value: Any, width: int = 80) -> str:
    text = "(unset)" if value is None else json.dumps(value, separators=(",", ":"), sort_keys=True)
    return text if len(text) <= width else text[:width - 1] + "…"
