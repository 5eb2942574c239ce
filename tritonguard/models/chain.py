"""An ensemble of this project's own backends (``tokenizer`` and ``runtime`` steps) run in one
process: what a guard with ``placement: inprocess`` runs for a text target such as
``minilm_raw_v1`` (tokenizer -> encoder).

Triton runs such an ensemble as two more processes and hops (the tokenizer's stub, then the
encoder's); a guard that waits on them over BLS holds its one instance idle meanwhile, so the
encoder gets only the batches the guard's own cycle lets it form. In process, the guard tokenises
its fused batch and runs the encoder's artifact itself with the same code those backends use
(:class:`tritonguard.models.tokenizer.Tokenizer`, :func:`tritonguard.models.engines.load_engine`),
on the versions the ensemble pins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core import repository
from tritonguard.core.config import from_params, model_parameters
from tritonguard.core.errors import ConfigError
from tritonguard.models.engines import EngineConfig, load_engine
from tritonguard.models.tokenizer import Tokenizer, TokenizerConfig, texts_of

log = logging.getLogger(__name__)

BACKENDS = ("tokenizer", "runtime")  # the step backends this module can run in process


@dataclass
class Step:
    model: str
    version: int
    inputs: dict[str, str]  # the step's input name -> the ensemble tensor it reads
    outputs: dict[str, str]  # the step's output name -> the ensemble tensor it writes
    run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def _version(repo: Path, model: str, pinned: Any) -> int:
    version = int(pinned if pinned not in (None, "") else -1)
    if version > 0:
        if version not in repository.complete_versions(repo / model):
            raise ConfigError(f"step '{model}' v{version} is not in {repo} (or has no manifest)")
        return version
    complete = repository.complete_versions(repo / model)
    if not complete:
        raise ConfigError(f"step '{model}' has no version in {repo}")
    return complete[-1]


def steps_of(ensemble: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list((ensemble.get("ensemble_scheduling") or {}).get("step") or [])


def runnable(repo: Path, ensemble: Mapping[str, Any]) -> str:
    """'' when every step of ``ensemble`` is served by one of :data:`BACKENDS`; else why not."""
    steps = steps_of(ensemble)
    if ensemble.get("platform") != "ensemble" or not steps:
        return f"'{ensemble.get('name')}' is not an ensemble"
    for step in steps:
        model = step.get("model_name", "")
        if not (Path(repo) / model / repository.CONFIG).exists():
            return f"its step '{model}' is not in {repo}"
        backend = repository.read_config(Path(repo) / model).get("backend")
        if backend not in BACKENDS:
            return f"its step '{model}' uses backend '{backend}' (in process: {', '.join(BACKENDS)})"
    return ""


class Chain:
    """``run(inputs) -> outputs`` of one ensemble over a fused batch, in this process."""

    def __init__(self, repo: Path, name: str, runtime_overrides: Mapping[str, str] | None = None):
        repo = Path(repo)
        self.name = name
        ensemble = repository.read_config(repo / name)
        why = runnable(repo, ensemble)
        if why:
            raise ConfigError(f"ensemble '{name}' cannot run in process: {why}")
        steps = [self._load(repo, s, runtime_overrides or {}) for s in steps_of(ensemble)]
        self.steps = self._ordered(name, steps, {i["name"] for i in ensemble.get("input") or []})

    @staticmethod
    def _load(repo: Path, step: Mapping[str, Any], overrides: Mapping[str, str]) -> Step:
        model = step["model_name"]
        version = _version(repo, model, step.get("model_version"))
        cfg = repository.read_config(repo / model)
        version_dir = repo / model / str(version)
        inputs = [i["name"] for i in cfg.get("input") or []]
        outputs = [o["name"] for o in cfg.get("output") or []]
        if cfg.get("backend") == "tokenizer":
            tcfg = from_params(TokenizerConfig, model_parameters(cfg), model=model)
            tok = Tokenizer(version_dir, tcfg, outputs, model=model)

            def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
                return tok.encode(texts_of(feed[tcfg.text_input]))
        else:
            # the step's own runtime parameters, overridden by the guard's runtime.* ones
            ecfg = from_params(EngineConfig, {**model_parameters(cfg), **overrides}, model=model)
            engine = load_engine(version_dir, ecfg, inputs, outputs)

            def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
                return engine.run(feed, outputs)
        return Step(model, version, dict(step.get("input_map") or {}), dict(step.get("output_map") or {}), run)

    @staticmethod
    def _ordered(name: str, steps: list[Step], inputs: set[str]) -> list[Step]:
        """The steps in an order where each reads only tensors written before it (Triton runs
        an ensemble's steps as their inputs become ready, whatever their order in the config)."""
        done, have, order = set(), set(inputs), []
        while len(order) < len(steps):
            ready = [k for k, s in enumerate(steps) if k not in done and set(s.inputs.values()) <= have]
            if not ready:
                raise ConfigError(f"ensemble '{name}': no step can run on {sorted(have)} (a step reads a "
                                  "tensor no earlier step writes)")
            for k in ready:
                done.add(k)
                order.append(steps[k])
                have |= set(steps[k].outputs.values())
        return order

    def run(self, inputs: Mapping[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        tensors = dict(inputs)
        for step in self.steps:  # each reads what the ensemble's inputs or earlier steps wrote
            got = step.run({own: tensors[ens] for own, ens in step.inputs.items()})
            for own, ens in step.outputs.items():
                tensors[ens] = got[own]
        return {n: tensors[n] for n in outputs}

    def models(self) -> list[tuple[str, int]]:
        return [(s.model, s.version) for s in self.steps]


__all__ = ["BACKENDS", "Chain", "runnable", "steps_of"]
