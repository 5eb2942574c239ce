"""The on-disk model repository: config.pbtxt (through Triton's own protobuf schema),
numeric version folders, and the per-version manifest and goldens the exporter writes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core.files import atomic_write

MANIFEST = "manifest.json"
GOLDENS = "goldens.npz"
CONFIG = "config.pbtxt"

log = logging.getLogger(__name__)


def _pb():
    from google.protobuf import json_format, text_format  # noqa: PLC0415
    from tritonclient.grpc import model_config_pb2  # noqa: PLC0415

    return model_config_pb2, text_format, json_format


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.pbtxt -> the same JSON shape Triton hands to ``initialize``."""
    mc, text_format, json_format = _pb()
    msg = mc.ModelConfig()
    text_format.Parse((Path(model_dir) / CONFIG).read_text(), msg)
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def render_config(config: dict[str, Any]) -> str:
    """Validate ``config`` against Triton's ModelConfig schema and render it as pbtxt."""
    mc, text_format, json_format = _pb()
    msg = json_format.ParseDict(config, mc.ModelConfig())
    return text_format.MessageToString(msg)


def write_config(model_dir: Path, config: dict[str, Any]) -> Path:
    path = Path(model_dir) / CONFIG
    atomic_write(path, render_config(config))
    return path


def guard_dir(repo: Path, model: str) -> tuple[Path, dict[str, Any]] | None:
    """(folder, config) of the guard that serves the public ``model``: ``model`` itself when
    its backend is ``guard``, or the step served by backend ``guard`` of the ensemble ``model``
    (``<name>`` = ``<name>_intake`` -> ``<name>_guard``, see :mod:`tritonguard.models.intake`); None
    otherwise. Raises what :func:`read_config` raises for an unreadable config."""
    repo = Path(repo)
    if not (repo / model / CONFIG).exists():
        return None
    cfg = read_config(repo / model)
    if cfg.get("backend") == "guard":
        return repo / model, cfg
    if cfg.get("platform") != "ensemble":
        return None
    for step in (cfg.get("ensemble_scheduling") or {}).get("step") or []:
        name = step.get("model_name", "")
        if name and (repo / name / CONFIG).exists():
            inner = read_config(repo / name)
            if inner.get("backend") == "guard":
                return repo / name, inner
    return None


def holds_state(model_dir: Path) -> bool:
    """A guard, or the ensemble a guard serves under: the folders where rollout state, latency
    samples and audit anchors are written (by the public name)."""
    model_dir = Path(model_dir)
    if not (model_dir / CONFIG).exists():
        return False
    return guard_dir(model_dir.parent, model_dir.name) is not None


def mirror(src: Path, dest: Path) -> Path:
    """A repository at ``dest`` serving what ``src`` serves without writing into it: the
    folders that :func:`holds_state` copied (without their state), every other model linked.
    For tests and benchmarks that must leave the exported repository as it was."""
    import shutil  # noqa: PLC0415

    src, dest = Path(src), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for model_dir in sorted(src.iterdir()):
        if not (model_dir / CONFIG).exists():
            continue
        if holds_state(model_dir):
            shutil.copytree(model_dir, dest / model_dir.name,
                            ignore=shutil.ignore_patterns("rollout_state.json*", ".rollout_state*", ".latency"))
        else:
            (dest / model_dir.name).symlink_to(model_dir.resolve())
    return dest


def versions(model_dir: Path) -> list[int]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def complete_versions(model_dir: Path) -> list[int]:
    """The versions a reader may use: those with a manifest. A version folder without one is
    still being written (an object store publishes the manifest after every other file of the
    version) or was never finished: it is logged and ignored, never served by a guard. A model
    none of whose versions has a manifest was placed by hand, not exported: all its versions."""
    model_dir = Path(model_dir)
    every = versions(model_dir)
    out = [v for v in every if (model_dir / str(v) / MANIFEST).is_file()]
    if not out:
        # a model placed by hand (never exported: no version has a manifest) is served as Triton
        # serves it; the rule guards exported models against a version caught mid-publish
        if every and (model_dir, 0) not in _REPORTED:
            _REPORTED.add((model_dir, 0))
            log.info("%s has no exported version (no %s in any): all its versions are used", model_dir.name,
                     MANIFEST)
        return every
    for v in every:
        if v not in out and (model_dir, v) not in _REPORTED:
            _REPORTED.add((model_dir, v))
            log.warning("%s version %d has no %s (incomplete or unverified): ignored", model_dir.name, v, MANIFEST)
    return out


_REPORTED: set[tuple[Path, int]] = set()  # each ignored version logged once per process


def write_placeholder(version_dir: Path, model: str) -> Path:
    """The file that makes a version folder of a model without an artifact (a guard, an ensemble)
    exist: an object store has no empty folders, and Triton wants one version. A manifest saying
    what the folder is, so it also counts as complete (:func:`complete_versions`)."""
    version_dir = Path(version_dir)
    version_dir.mkdir(parents=True, exist_ok=True)
    path = version_dir / MANIFEST
    if not path.exists():
        doc = {"name": model, "version": int(version_dir.name) if version_dir.name.isdigit() else version_dir.name,
               "placeholder": True, "about": "no artifact: this model is served by its backend's code"}
        atomic_write(path, json.dumps(doc, indent=2) + "\n")
    return path


def latest_version(model_dir: Path) -> int | None:
    vs = versions(model_dir)
    return vs[-1] if vs else None


def read_manifest(version_dir: Path) -> dict[str, Any] | None:
    path = Path(version_dir) / MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())


def version_with_artifact(model_dir: Path, sha256: str, *, exclude: int | None = None) -> int | None:
    """The latest version of ``model_dir`` whose manifest records the artifact ``sha256``
    (other than ``exclude``), or None: an export or a judge tells a re-export of the same weights
    from a new model by it."""
    if not sha256:
        return None
    return next((v for v in reversed(versions(model_dir))
                 if v != exclude and (read_manifest(Path(model_dir) / str(v)) or {}).get("sha256") == sha256), None)


def load_goldens(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(inputs, outputs) from a goldens.npz (``in__NAME`` / ``out__NAME``). BYTES are stored as
    fixed-width ``S`` arrays so reading never needs ``allow_pickle``; they come back as object
    arrays of bytes, the form Triton clients and the BYTES backends use."""
    ins: dict[str, np.ndarray] = {}
    outs: dict[str, np.ndarray] = {}
    with np.load(path, allow_pickle=False) as data:
        for key in data.files:
            arr = data[key]
            if arr.dtype.kind == "S":
                arr = arr.astype(object)
            if key.startswith("in__"):
                ins[key[4:]] = arr
            elif key.startswith("out__"):
                outs[key[5:]] = arr
    return ins, outs
