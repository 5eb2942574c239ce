"""The ``guard`` Python-based backend: validate a whole batch, call the target once, split.

Two placements of the same pipeline:
- ``bls`` (default): the target is any Triton model or ensemble, reached by one fused BLS call
  per ``execute()``;
- ``inprocess``: the target is served by our ``runtime`` backend; the guard loads the same
  artifact with the same engine code and skips the second stub hop (for small, fast models the
  hop costs more than the model).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core import repository
from tritonguard.core.config import from_params, model_parameters
from tritonguard.core.errors import ConfigError, InvalidInput, TargetError
from tritonguard.core.tensors import ModelSignature
from tritonguard.guard import source
from tritonguard.guard.config import (
    SERVED_BY,
    GuardConfig,
    TargetConfig,
    check_signature,
    load_guard_config,
)
from tritonguard.guard.pipeline import Batch, Pipeline
from tritonguard.guard.routing.router import Router
from tritonguard.guard.services import PrivacyStage, audit_file, enforce_security, security_findings
from tritonguard.guard.stages.cost import CostStage
from tritonguard.guard.stages.feedback import FeedbackStage
from tritonguard.guard.stages.respond import RespondStage
from tritonguard.guard.stages.route import RouteStage
from tritonguard.guard.stages.trace import TraceStartStage, TraceTagStage
from tritonguard.guard.stages.validate import ValidateStage
from tritonguard.guard.validation import BatchValidator
from tritonguard.models import chain
from tritonguard.models.engines import EngineConfig, load_engine
from tritonguard.observe.cost import cost_meter
from tritonguard.observe.tracing import Tracer
from tritonguard.rollout.feedback import recorder_for as feedback_recorder
from tritonguard.rollout.latency import recorder_for
from tritonguard.rollout.replicas import served_versions, start_heartbeat
from tritonguard.rollout.stores import open_store
from tritonguard.rollout.validators import ValidatorRegistry
from tritonguard.triton import backend as triton
from tritonguard.triton.metrics import Metrics

log = logging.getLogger(__name__)


class BlsTarget:
    def __init__(self, name: str, version: int, outputs: list[str], max_batch: int, timeout_ms: int,
                 served_as: str = ""):
        self.name, self.version, self.outputs = name, version, outputs
        self.max_batch = max_batch
        self.timeout_us = timeout_ms * 1000
        self.served_by = served_as or f"{name}:{version if version > 0 else 'latest'}"

    def infer(self, fused: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = len(next(iter(fused.values())))
        if not self.max_batch or rows <= self.max_batch:
            return triton.bls(self.name, self.version, fused, self.outputs, timeout_us=self.timeout_us)
        parts = [
            triton.bls(self.name, self.version, {k: v[i:i + self.max_batch] for k, v in fused.items()},
                       self.outputs, timeout_us=self.timeout_us)
            for i in range(0, rows, self.max_batch)
        ]
        return {n: np.concatenate([p[n] for p in parts]) for n in self.outputs}


def latest_version(repo: Path, name: str) -> int:
    complete = repository.complete_versions(repo / name)
    if not complete:
        raise ConfigError(f"target '{name}' has no version folder in {repo / name}")
    return complete[-1]


class InProcessTarget:
    """A target version run by the guard itself: ``engine`` is a runtime artifact's engine or an
    in-process :class:`~tritonguard.models.chain.Chain` (a tokenizer -> encoder ensemble)."""

    def __init__(self, name: str, version: int, engine: Any, outputs: list[str]):
        self.name, self.version, self.outputs = name, version, outputs
        self.served_by = f"{name}:{version}"
        self.engine = engine

    def infer(self, fused: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            return self.engine.run(fused, self.outputs)
        except Exception as exc:  # the engine's message may hold paths: keep it in the log
            log.exception("in-process target %s failed", self.served_by)
            raise TargetError(f"target '{self.name}' failed to run the batch: {type(exc).__name__}") from None


class GuardModel:
    def initialize(self, args: dict[str, str]) -> None:
        a = triton.prologue(args)
        cfg = a.config
        self.name, self.version = a.name, a.version
        # the repository itself, never the parent of Triton's temporary copy (tritonguard/guard/source.py)
        self.source = source.resolve(a.name, a.model_dir, os.environ)
        repo = self.repo = self.source.root
        # defaults < [tool.tritonguard] in pyproject.toml < TRITONGUARD_* < config.pbtxt; logs
        # each non-default setting with the layer it came from
        params, self.config = load_guard_config(model_parameters(cfg), repo, os.environ, self.name)
        if self.config.target.serves_as:
            self.name = self.config.target.serves_as
        self.signature = ModelSignature.from_config(cfg)
        self.config.validation.check_against(self.signature, self.name)
        self.input_names = [s.name for s in self.signature.inputs]
        self.output_names = [s.name for s in self.signature.outputs if s.name != SERVED_BY]
        self.served_by_output = any(s.name == SERVED_BY for s in self.signature.outputs)
        self._served = False  # set by the first execute()

        tcfg = self.config.target
        self.source.fetch(tcfg.target)  # an object-store repository: the target's complete versions
        target_dir = repo / tcfg.target
        target_config = None
        if (target_dir / repository.CONFIG).exists():
            target_config = repository.read_config(target_dir)
            check_signature(self.signature, ModelSignature.from_config(target_config), tcfg.target)
        elif tcfg.placement == "inprocess":
            raise ConfigError(f"model '{self.name}': in-process target '{tcfg.target}' not found in {repo}")
        else:
            log.warning("guard %s: target %s is not in this repository; validating against the guard's own config",
                        self.name, tcfg.target)

        if tcfg.placement == "inprocess":
            overrides = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith("runtime.")}
            make_target, cost_config = self._inprocess_targets(repo, tcfg, target_config, overrides)
            ready = None  # the guard runs the artifact itself: always ready
        else:
            def make_target(version: int) -> BlsTarget:  # type: ignore[misc]
                source.check_complete(repo, tcfg.target, version)
                if tcfg.target_per_version and version > 0:
                    return BlsTarget(tcfg.target_per_version.format(version=version), -1, self.output_names,
                                     self.signature.max_batch_size, tcfg.timeout_ms, served_as=f"{tcfg.target}:{version}")
                return BlsTarget(tcfg.target, version, self.output_names, self.signature.max_batch_size,
                                 tcfg.timeout_ms)

            # Goldens ahead of traffic over BLS wait until this guard has served a batch: by then
            # Triton serves the targets (no BLS in initialize(); and pb_utils' model-control
            # calls such as is_model_ready, made from a thread, aborted the server here)
            def ready(_version: int) -> bool:
                return self._served

        instances = a.instances
        # startup security check: hard failures refuse the load, the rest are logged warnings
        enforce_security(self.name, security_findings(self.config, self.signature, params, instances=instances))
        self.validator = BatchValidator(self.signature, self.config.validation)
        self.metrics = Metrics(self.name, self.version)
        runtime_overrides = {k: v for k, v in params.items() if k.startswith("runtime.")}
        self.privacy = PrivacyStage(
            guard=self.name, target=tcfg.target, signature=self.signature, output_names=self.output_names,
            config=self.config, repo=repo, metrics=self.metrics,
            audit_path=audit_file(self.config.audit.path, model=self.name,
                                  instance=a.instance, instances=instances),
            # settings that change what the target answers for the same inputs
            key_params={"placement": tcfg.placement, "runtime": runtime_overrides},
        )
        self.router = Router(
            guard=self.name, repo=repo, target=tcfg.target, make_target=make_target,
            output_names=self.output_names, store=open_store(self.name, repo), config=self.config.routing,
            validator=self.config.validator, registry=ValidatorRegistry.from_config(self.config.validator),
            breaker=self.config.breaker, metrics=self.privacy.wrap_metrics(self.metrics), pin=tcfg.target_version,
            ready=ready, max_batch=self.signature.max_batch_size, latency=recorder_for(self.name, repo),
            # an object-store repository: a version is routed to once it is fetched and checked here
            present=self._present if self.source.remote else None,
        )
        self.privacy.attach(self.router)
        if self.source.remote:
            self._fetch_named_versions()
        # this replica in the shared store's registry (Redis only): the exporter finds it there
        self.heartbeat = start_heartbeat(self.name, lambda: served_versions(self.router.state))
        # compute and cost per answered request (tritonguard.observe.cost): fed once per batch, below
        self.cost = cost_meter(self.config.cost, placement=tcfg.placement,
                               target_config=cost_config if tcfg.placement == "inprocess" else target_config,
                               params=params,
                               instance_kind=a.instance_kind, metrics=self.metrics,
                               label=self.privacy.label)
        self.router.goldens.uncharged = self.cost.uncharged  # a golden check is nobody's request
        # spans per safety stage (OpenTelemetry); None when tracing.endpoint is unset: then the
        # SDK is never imported and each batch pays one `is None` test
        self.tracer: Tracer | None = None
        if self.config.tracing.enabled:
            self.tracer = Tracer(self.config.tracing, model=self.name,
                                 instance=a.instance, metrics=self.metrics)
            self.router.tracer = self.tracer
            log.info("guard %s: tracing to %s (sample ratio %g for requests without a traced parent)",
                     self.name, self.config.tracing.endpoint, self.config.tracing.sample_ratio)
        # the path of every batch, in order, holding only the stages this guard's config needs
        # (tritonguard/guard/pipeline.py; each stage is one concern in tritonguard/guard/stages/)
        traced = self.tracer is not None
        self.pipeline = Pipeline([
            ValidateStage(self.validator, self.input_names, self.metrics),
            *([TraceStartStage(self.tracer)] if traced else []),
            *self.privacy.inbound,
            *([TraceTagStage(self.privacy.label)] if traced else []),
            RouteStage(self.router),
            *self.privacy.outbound,
            RespondStage(self.output_names),
            *self._feedback(),
            *self.privacy.closing,
            CostStage(self.cost),
        ])
        log.info("guard %s: stages %s", self.name, " -> ".join(self.pipeline.names()))
        if tcfg.placement == "inprocess":
            # goldens on the serving hardware before any traffic; a primary that fails them
            # fails the load, so the model reports not ready instead of serving wrong answers
            primary = self.router.primary()
            verdict = self.router.golden_verdict(primary)
            if verdict == "FAIL":
                figures = self.router.state.goldens.get(str(primary), {}).get("metrics")
                self.router.close()
                self.privacy.close()
                raise ConfigError(f"model '{self.name}': primary {tcfg.target} v{primary} failed its goldens "
                                  f"on this server: {figures}")
        # the collector's counts are where the load left them (a BLS digits guard: 9 of 10 gen-1
        # passes toward a full one, 28 ms over the load's objects; a text guard's takes 50-150 ms):
        # that full pass runs now, in the load, not in one of the first requests
        gc.collect()
        # the load above (engines, goldens) ran on the serving thread: no tenant's request pays it
        load_s = self.cost.loaded()
        log.info("guard %s v%s -> %s primary v%d (%s); load took %.2f CPU s, charged to no tenant", self.name,
                 self.version, tcfg.target, self.router.primary(), tcfg.placement, load_s)

    def _inprocess_targets(self, repo: Path, tcfg: TargetConfig, target_config: dict[str, Any],
                           overrides: dict[str, str]) -> tuple[Any, dict[str, Any]]:
        """``(make_target, the config that prices a call)`` for ``placement: inprocess``: a target
        served by backend ``runtime`` (its artifact), or an ensemble of ``tokenizer`` and
        ``runtime`` steps such as a text model's (:mod:`tritonguard.models.chain`; with
        ``target_per_version``, version N runs the ensemble of that name)."""
        target = tcfg.target
        if target_config.get("backend") == "runtime":
            # the target's own runtime parameters, overridden by the guard's runtime.* ones
            engine_cfg = from_params(EngineConfig, {**model_parameters(target_config), **overrides}, model=target)
            input_names = [s.name for s in self.signature.inputs]

            def make_target(version: int) -> InProcessTarget:
                source.check_complete(repo, target, version)
                version = version if version > 0 else latest_version(repo, target)
                engine = load_engine(repo / target / str(version), engine_cfg, input_names, self.output_names)
                return InProcessTarget(target, version, engine, self.output_names)

            return make_target, target_config
        for step in chain.steps_of(target_config):  # an object-store repository: bring them here
            self.source.fetch(step.get("model_name", ""))
        why = chain.runnable(repo, target_config)
        if why:
            raise ConfigError(f"model '{self.name}': placement 'inprocess' needs a target served by backend "
                              f"'runtime' or an ensemble of {' and '.join(chain.BACKENDS)} steps; '{target}': {why}")

        def ensemble_of(version: int) -> str:
            return tcfg.target_per_version.format(version=version) if tcfg.target_per_version else target

        def make_chain_target(version: int) -> InProcessTarget:
            source.check_complete(repo, target, version)
            version = version if version > 0 else latest_version(repo, target)
            name = ensemble_of(version)
            self.source.fetch(name)
            for step in chain.steps_of(repository.read_config(repo / name)):
                self.source.fetch(step["model_name"])
            return InProcessTarget(target, version, chain.Chain(repo, name, overrides), self.output_names)

        # a call is priced by the step that runs an artifact (its threads), as if served alone
        runtime_steps = [repository.read_config(repo / s["model_name"]) for s in chain.steps_of(target_config)]
        cost_config = next((c for c in runtime_steps if c.get("backend") == "runtime"), target_config)
        return make_chain_target, cost_config

    def _present(self, version: int) -> bool:
        return self.source.present(self.config.target.target, version)

    def _fetch_named_versions(self) -> None:
        """An object-store repository: the versions the rollout state names are fetched in the
        background (:func:`tritonguard.guard.source.follow_rollout`); an in-process guard also
        loads each on the fetcher's thread, before it is routed to."""
        view, target = self.router.view, self.config.target.target

        def prepare(versions: list[int]) -> None:
            if self.config.target.placement != "inprocess":
                return
            named = set(view.named_versions())
            for version in versions:
                if version in named:
                    try:
                        self.router.target_for(version)
                    except TargetError as exc:  # routed to, it fails its requests as any broken version
                        log.warning("guard %s: %s v%d fetched but not loaded: %s", self.name, target, version, exc)

        source.follow_rollout(self.source, view, target, self._present, guard=self.name, prepare=prepare)

    def _feedback(self) -> list[FeedbackStage]:
        """What each version answered, for late labels, and the labels sent with requests
        (``feedback.*``); the stage stays (counting request labels) when the log cannot open."""
        cfg = self.config
        recorder = feedback_recorder(self.name, self.repo, cfg.feedback)
        # the task of the primary's manifest (as the router's comparisons read it) says whether
        # an answer is a class id to score labels on, or only a digest
        workload = self.router.validator_for(self.router.primary()).workload
        return [FeedbackStage(recorder, self.metrics, output=cfg.validator.output or self.output_names[0],
                              classifier=workload == "classifier", sample=cfg.feedback.sample)]

    # -- serving ----------------------------------------------------------------------
    def execute(self, requests: list[Any]) -> list[Any]:
        responses: list[Any] = [None] * len(requests)
        try:
            self._execute(requests, responses)
        except Exception:  # noqa: BLE001 - a bug must never fail the server or leak a traceback
            log.exception("guard %s: internal error", self.name)
            for i, r in enumerate(responses):
                if r is None:
                    responses[i] = triton.error(f"internal error in guard '{self.name}' (details in the server log)")
        return responses

    def _execute(self, requests: list[Any], responses: list[Any]) -> None:
        self._served = True
        self.metrics.inc("requests", len(requests))
        # parsed once per batch (most requests carry none: a string compare each), for the
        # tenant, the ground-truth labels the rollout's gates score, pins and tracing
        batch = Batch(requests=requests, responses=responses,
                      params=[triton.request_parameters(r) for r in requests],
                      served_by=([self._wants_served_by(r) for r in requests] if self.served_by_output
                                 else [False] * len(requests)))
        if self.tracer is None:
            self.pipeline.run(batch)
            return
        batch.clock = (time.time_ns(), time.perf_counter_ns())
        try:
            self.pipeline.run(batch)
        finally:
            if batch.trace is not None:
                batch.trace.finish()

    @staticmethod
    def _wants_served_by(request: Any) -> bool:
        names = triton.requested_outputs(request)
        return names is None or SERVED_BY in names

    def finalize(self) -> None:
        self.router.close()
        self.source.close()
        if getattr(self, "heartbeat", None) is not None:
            self.heartbeat.stop()
        self.pipeline.close()  # the cost meter; the privacy services close below
        if self.tracer is not None:
            self.tracer.close()
        self.privacy.close()
        self.metrics.close()


__all__ = ["GuardModel", "GuardConfig", "TargetConfig", "InvalidInput", "SERVED_BY"]
