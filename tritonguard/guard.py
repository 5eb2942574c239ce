"""The ``guard`` Python-based backend: validate a whole batch, call the target once, split.

Two placements of the same pipeline:
- ``bls`` (default): the target is any Triton model or ensemble, reached by one fused BLS call
  per ``execute()``;
- ``inprocess``: the target is served by our ``runtime`` backend; the guard loads the same
  artifact with the same engine code and skips the second stub hop (for small, fast models the
  hop costs more than the model).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import repository, triton
from .config import from_params, layered_parameters, model_parameters
from .cost import cost_meter
from .engines import EngineConfig, load_engine
from .errors import ConfigError, InvalidInput, TargetError
from .guard_config import SERVED_BY, GuardConfig, TargetConfig
from .privacy import PrivacyStage, audit_file, enforce_security, security_findings
from .routing import Router
from .state import open_store
from .tensors import ModelSignature, TensorSpec, offsets, split
from .tracing import Tracer
from .validation import BatchValidator
from .validators import ValidatorRegistry

log = logging.getLogger(__name__)


def check_signature(guard: ModelSignature, target: ModelSignature, target_name: str) -> None:
    """The guard's public contract must be the target's: same names, dtypes, dims, batch cap."""

    def fmt(s: TensorSpec) -> str:
        return f"{s.name}:{s.triton_type}{list(s.dims)}"

    problems = []
    t_in = {s.name: s for s in target.inputs}
    for s in guard.inputs:
        other = t_in.get(s.name)
        if other is None:
            problems.append(f"input {s.name} is not an input of the target")
        elif other.dtype != s.dtype or len(other.dims) != len(s.dims) or any(
            o != -1 and g != o for g, o in zip(s.dims, other.dims, strict=True)
        ):
            problems.append(f"input {fmt(s)} != target's {fmt(other)}")
    t_out = {s.name: s for s in target.outputs}
    for s in guard.outputs:
        if s.name == SERVED_BY:
            continue
        if s.name not in t_out:
            problems.append(f"output {s.name} is not an output of the target")
    if target.max_batch_size and guard.max_batch_size > target.max_batch_size:
        problems.append(f"max_batch_size {guard.max_batch_size} > target's {target.max_batch_size}")
    if problems:
        raise ConfigError(f"guard does not match target '{target_name}': " + "; ".join(problems))


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


class InProcessTarget:
    def __init__(self, repo: Path, name: str, version: int, cfg: EngineConfig, signature: ModelSignature,
                 outputs: list[str]):
        model_dir = repo / name
        if version <= 0:
            latest = repository.latest_version(model_dir)
            if latest is None:
                raise ConfigError(f"target '{name}' has no version folder in {model_dir}")
            version = latest
        self.name, self.version, self.outputs = name, version, outputs
        self.served_by = f"{name}:{version}"
        self.engine = load_engine(model_dir / str(version), cfg, [s.name for s in signature.inputs], outputs)

    def infer(self, fused: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            return self.engine.run(fused, self.outputs)
        except Exception as exc:  # the engine's message may hold paths: keep it in the log
            log.exception("in-process target %s failed", self.served_by)
            raise TargetError(f"target '{self.name}' failed to run the batch: {type(exc).__name__}") from None


class GuardModel:
    def initialize(self, args: dict[str, str]) -> None:
        triton.setup_logging()
        cfg = triton.model_config(args)
        self.name = args["model_name"]
        self.version = args["model_version"]
        repo = Path(args["model_repository"]).parent
        # defaults < [tool.tritonguard] in pyproject.toml < TRITONGUARD_* < config.pbtxt
        params = layered_parameters(model_parameters(cfg), repo, os.environ)
        try:
            self.config = GuardConfig.from_parameters(params, self.name)
        except ConfigError as exc:
            raise ConfigError(_with_source(str(exc), params)) from None
        if self.config.target.serves_as:
            self.name = self.config.target.serves_as
        self.signature = ModelSignature.from_config(cfg)
        self.config.validation.check_against(self.signature, self.name)
        self.input_names = [s.name for s in self.signature.inputs]
        self.output_names = [s.name for s in self.signature.outputs if s.name != SERVED_BY]
        self.served_by_output = any(s.name == SERVED_BY for s in self.signature.outputs)
        self._served = False  # set by the first execute()

        tcfg = self.config.target
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
            if target_config.get("backend") != "runtime":
                raise ConfigError(f"model '{self.name}': placement 'inprocess' needs a target served by backend "
                                  f"'runtime', '{tcfg.target}' uses '{target_config.get('backend') or target_config.get('platform')}'")
            # the target's own runtime parameters, overridden by the guard's runtime.* ones
            eng_params = {**model_parameters(target_config),
                          **{k.split(".", 1)[1]: v for k, v in params.items() if k.startswith("runtime.")}}
            engine_cfg = from_params(EngineConfig, eng_params, model=tcfg.target)

            def make_target(version: int) -> InProcessTarget:
                return InProcessTarget(repo, tcfg.target, version, engine_cfg, self.signature, self.output_names)

            ready = None  # the guard runs the artifact itself: always ready
        else:
            def make_target(version: int) -> BlsTarget:  # type: ignore[misc]
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

        instances = sum(int(g.get("count", 1)) for g in cfg.get("instance_group") or [{}]) or 1
        # startup security check: hard failures refuse the load, the rest are logged warnings
        enforce_security(self.name, security_findings(self.config, self.signature, params, instances=instances))
        self.validator = BatchValidator(self.signature, self.config.validation)
        self.metrics = triton.Metrics(self.name, self.version)
        runtime_overrides = {k: v for k, v in params.items() if k.startswith("runtime.")}
        self.privacy = PrivacyStage(
            guard=self.name, target=tcfg.target, signature=self.signature, output_names=self.output_names,
            config=self.config, repo=repo, metrics=self.metrics,
            audit_path=audit_file(self.config.audit.path, model=self.name,
                                  instance=args.get("model_instance_name", self.name), instances=instances),
            # settings that change what the target answers for the same inputs
            key_params={"placement": tcfg.placement, "runtime": runtime_overrides},
        )
        self.router = Router(
            guard=self.name, repo=repo, target=tcfg.target, make_target=make_target,
            output_names=self.output_names, store=open_store(self.name, repo), config=self.config.routing,
            validator=self.config.validator, registry=ValidatorRegistry.from_config(self.config.validator),
            breaker=self.config.breaker, metrics=self.privacy.wrap_metrics(self.metrics), pin=tcfg.target_version,
            ready=ready, max_batch=self.signature.max_batch_size, latency=_latency_recorder(self.name, repo),
        )
        self.privacy.attach(self.router)
        # compute and cost per answered request (tritonguard.cost): fed once per batch, below
        self.cost = cost_meter(self.config.cost, placement=tcfg.placement, target_config=target_config, params=params,
                               instance_kind=args.get("model_instance_kind", ""), metrics=self.metrics,
                               label=self.privacy.label)
        # spans per safety stage (OpenTelemetry); None when tracing.endpoint is unset: then the
        # SDK is never imported and each batch pays one `is None` test
        self.tracer: Tracer | None = None
        if self.config.tracing.enabled:
            self.tracer = Tracer(self.config.tracing, model=self.name,
                                 instance=args.get("model_instance_name", ""), metrics=self.metrics)
            self.router.tracer = self.tracer
            log.info("guard %s: tracing to %s (sample ratio %g for requests without a traced parent)",
                     self.name, self.config.tracing.endpoint, self.config.tracing.sample_ratio)
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
        log.info("guard %s v%s -> %s primary v%d (%s)", self.name, self.version, tcfg.target,
                 self.router.primary(), tcfg.placement)

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
        if self.tracer is None:
            self._run(requests, responses, None)
            return
        clock = (time.time_ns(), time.perf_counter_ns())
        try:
            self._run(requests, responses, clock)
        finally:
            tb, self._batch_trace = self._batch_trace, None
            if tb is not None:
                tb.finish()

    _batch_trace: Any = None  # the BatchTrace of the batch in execute(), when it has traced requests

    def _run(self, requests: list[Any], responses: list[Any], clock: tuple[int, int] | None) -> None:
        self._served = True
        self.metrics.inc("requests", len(requests))
        inputs, unreadable = [], {}
        for i, r in enumerate(requests):  # per request: one unreadable tensor fails its own request
            try:
                inputs.append(triton.request_inputs(r, self.input_names))
            except InvalidInput as exc:
                inputs.append({})  # fails validation ("presence"); the read error replaces that below
                unreadable[i] = exc
        verdict = self.validator.validate(inputs)
        for i, exc in unreadable.items():
            verdict.errors[i] = exc
        rejects: dict[str, int] = {}
        for i, err in enumerate(verdict.errors):
            if err is not None:
                responses[i] = triton.error(err)
                rejects[err.rule] = rejects.get(err.rule, 0) + 1
        for rule, n in rejects.items():
            self.metrics.inc("rejects", n, reason=rule)
        # parsed once per batch (most requests carry none: a string compare each), for the
        # tenant and for the ground-truth labels the rollout's gates score
        params = [triton.request_parameters(r) for r in requests]
        tenancy_params = params if self.privacy.needs_parameters else None
        tb = None
        if clock is not None:
            tb = self._batch_trace = self._trace_begin(requests, params, verdict, clock)
        if not verdict.valid:
            if self.privacy.audit.enabled:
                self.privacy.before(tenancy_params, verdict, trace=tb)  # audits the rejects
            return
        # tenants, quotas, redaction, cache lookups: what is left goes to the router
        batch = self.privacy.before(tenancy_params, verdict, trace=tb)
        for i, err in batch.errors.items():
            responses[i] = triton.error(err)
        if tb is not None:
            for i in tb.sampled:
                tb.set(i, **{"tritonguard.tenant": self.privacy.label(batch.tenants[i]) if batch.tenants[i] else "",
                             "tritonguard.cache": batch.cache_state.get(i, "off")})
                if i in batch.hits:
                    tb.set(i, **{"tritonguard.served_by": batch.cache_label})
                    if i in batch.hit_tiers:
                        tb.set(i, **{"tritonguard.cache.tier": batch.hit_tiers[i]})
        routed = None
        # SERVED_BY only for requests that ask for it (or name no outputs, and so get them all):
        # a BYTES tensor per response is measurable work on the hot path
        served_by = ([self._wants_served_by(r) for r in requests] if self.served_by_output
                     else [False] * len(requests))
        try:
            for i, outs in batch.hits.items():
                if served_by[i]:
                    outs = {**outs, SERVED_BY: np.full((batch.hit_sizes[i], 1), batch.cache_label.encode(), dtype=object)}
                responses[i] = triton.response(outs)
            if batch.route:
                labels = [_label(params[i]) for i in batch.route]
                pins = [_pin(params[i]) for i in batch.route]
                traced = ({k: tb.sampled[i] for k, i in enumerate(batch.route) if i in tb.sampled}
                          if tb is not None else None)
                routed = self.router.infer(batch.fused, batch.sizes, labels if any(x is not None for x in labels) else None,
                                           pins if any(x is not None for x in pins) else None, traced=traced or None)
                if tb is not None:
                    self._trace_routed(tb, batch, routed)
                self.privacy.redact_outputs(batch, routed)
                if tb is not None and self.privacy.redact_out:
                    tb.mark("redact", **{"tritonguard.redact.direction": "output"})
                self._respond(batch, routed, responses, served_by)
                if tb is not None:
                    tb.mark("respond")
        finally:
            self.privacy.after(batch, routed, trace=tb)  # cache fill, audit, quota release; never raises
        self.router.publish()
        self.cost.record(batch, routed, self.router.calls)

    def _trace_begin(self, requests: list[Any], params: list[dict[str, Any]], verdict: Any,
                     clock: tuple[int, int]) -> Any:
        """The batch's traced requests (None when none is), with validation as their first stage."""
        assert self.tracer is not None
        validated = time.time_ns()
        tb = self.tracer.begin(requests, params, *clock)
        if tb is None:
            return None
        tb.marks.append(("validate", validated, {}))
        for i, err in enumerate(verdict.errors):
            if err is not None:
                tb.left(i, "validate", err.rule, str(err))
        return tb

    def _trace_routed(self, tb: Any, batch: Any, routed: Any) -> None:
        tb.mark("route")
        tb.calls = [(v, [batch.route[k] for k in idx], s, e, ok) for v, idx, s, e, ok in self.router.calls]
        for k, i in enumerate(batch.route):
            if i not in tb.sampled:
                continue
            served = routed.served_by[k]
            tb.set(i, **{"tritonguard.served_by": served,
                         "tritonguard.target_version": served.rpartition(":")[2] if ":" in served else served})
            err = routed.errors[k]
            if err is not None:
                tb.errors[i] = (err.code, str(err))

    @staticmethod
    def _wants_served_by(request: Any) -> bool:
        names = triton.requested_outputs(request)
        return names is None or SERVED_BY in names

    def _respond(self, batch: Any, routed: Any, responses: list[Any], served_by: list[bool]) -> None:
        good_sizes = [batch.sizes[k] for k in range(len(batch.route)) if routed.errors[k] is None]
        parts = {n: split(routed.outputs[n], offsets(good_sizes)) for n in self.output_names}
        labels: dict[tuple[int, str], np.ndarray] = {}  # one SERVED_BY array per size and version
        j = 0
        for k, i in enumerate(batch.route):
            err = routed.errors[k]
            if err is not None:
                responses[i] = triton.error(err)
                continue
            outs = {n: parts[n][j] for n in self.output_names}
            if served_by[i]:
                key = (batch.sizes[k], routed.served_by[k])
                label = labels.get(key)
                if label is None:
                    label = labels[key] = np.full((key[0], 1), key[1].encode(), dtype=object)
                outs[SERVED_BY] = label
            responses[i] = triton.response(outs)
            j += 1

    def finalize(self) -> None:
        self.router.close()
        self.cost.close()
        if self.tracer is not None:
            self.tracer.close()
        self.privacy.close()
        self.metrics.close()


def _latency_recorder(guard: str, repo: Path) -> Any:
    """Exact per-call latencies of each target version, flushed by the router's reconciler to
    the state's store for the rollout's latency gate. None (logged) when no log can be opened:
    serving never depends on it."""
    try:
        from .latency import LatencyRecorder, open_latency_log  # noqa: PLC0415

        return LatencyRecorder(open_latency_log(guard, repo))
    except Exception as exc:  # noqa: BLE001 - e.g. a bad TRITONGUARD_STATE_URL: say so, serve on
        log.warning("guard %s: latency samples not kept (%s: %s)", guard, type(exc).__name__, exc)
        return None


def _label(params: dict[str, Any]) -> Any:
    """The ground truth a client sent with a request (request parameter ``label``: a class id,
    or ids separated by commas for a request of several rows), or None. The rollout's gates
    compare the versions' accuracy on it; a label that does not parse is ignored, never an error
    (it is feedback, not an input)."""
    raw = params.get("label")
    if raw is None or isinstance(raw, bool):
        return None
    try:
        return [int(raw)] if isinstance(raw, int) else [int(x) for x in str(raw).split(",")]
    except ValueError:
        return None


def _pin(params: dict[str, Any]) -> int | None:
    """The version a request must be answered by (request parameter ``version``), or None; a
    value that is not a whole number is 0, which the router refuses with INVALID_ARGUMENT."""
    raw = params.get("version")
    if raw is None:
        return None
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    text = str(raw).strip()
    return int(text) if text.isascii() and text.isdigit() else 0


def _with_source(message: str, params: Any) -> str:
    """Name the layer (pyproject.toml, environment, config.pbtxt) of a key a config error quotes."""
    sources = getattr(params, "sources", {})
    for key, source in sources.items():
        if f"'{key}'" in message and source != "config.pbtxt":
            return f"{message} (set in {source})"
    return message


__all__ = ["GuardModel", "GuardConfig", "TargetConfig", "InvalidInput", "SERVED_BY"]
