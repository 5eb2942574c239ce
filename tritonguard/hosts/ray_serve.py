"""The guard as a Ray Serve deployment, for a model served by Ray Serve instead of Triton.

::

    from ray import serve
    from tritonguard.hosts.ray_serve import guarded

    app = guarded("digits_raw", repository="model_repository", config={"tenancy.quotas": {"*": {"rps": 50}}})
    serve.run(app, route_prefix="/digits_raw")

When ``model`` is a guard in the repository (``exporter export`` writes ``digits`` fronting
``digits_raw``), it is served as the Triton guard serves it: the rollout state, the metrics'
``model`` label and the audit by the guard's name, the versions from its ``target``'s folder, and
the guard's keys that apply here from its ``config.pbtxt`` (:func:`settings`), so ``exporter route``
and ``exporter promote`` (``--metrics-url <route_prefix>/metrics``) move both hosts. Versions come from the same model repository the exporter writes
(``<repository>/<target>/<N>/`` with ``model.onnx`` and ``manifest.json``; a version without a
manifest is not served, as on Triton), each in an onnxruntime session; a version the rollout
state names that was exported after the replica started is loaded then; ``versions={3: fn}`` adds (or replaces) a version with a
Python callable ``fn(inputs: dict[str, ndarray]) -> dict[str, ndarray]`` (sync or async) or a bound
Ray Serve deployment (``MyModel.bind()``: called through its handle with the same dict). The
tensor signature (names, dtypes, dims, ``max_batch_size``) is the model's ``config.pbtxt``.

A request is KServe v2 JSON, as Triton's HTTP endpoint takes it: ``POST <route_prefix>/infer``
(any POST path) with ``{"inputs": [{"name", "shape", "datatype", "data"}]}``; the answer has
``outputs`` in the same shape, ``model_version`` and the ``x-tritonguard-served-by`` header
(``<model>:<version>``, the guard's ``SERVED_BY``). ``GET <route_prefix>/metrics``: the guard's
metric families under their catalogue names, for the whole application: each replica publishes
its counts to the rollout state's store and the route answers their sum (gauges: the max over
live replicas; :mod:`tritonguard.hosts.replica_metrics`), so ``exporter promote`` judges an
application of any number of replicas. Without a store (no repository, no state URL) a replica
answers its own.

On each request, in the guard's order:

1. **admission** (``tenancy.*``): :class:`~tritonguard.hosts.common.Admission`, the guard's
   resolver and quota managers (401 / 403 / 400, 429 with ``Retry-After``);
2. **redaction** (``redaction.*``): the strings of BYTES inputs (and with
   ``redaction.redact_outputs`` of BYTES outputs);
3. **batching**: ``@serve.batch`` gathers concurrent requests of the replica, as Triton's dynamic
   batcher does; its ``max_batch_size`` and wait are the model config's ``max_batch_size`` and
   ``dynamic_batching.max_queue_delay_microseconds`` unless given;
4. **validation** (``validation.*``) over the whole batch with the guard's
   :class:`~tritonguard.guard.validation.BatchValidator`: a bad request gets a 400 naming the
   input and the rule, its neighbours go on;
5. **routing** by the rollout state of ``model`` in the same store as the guard's (the file
   beside the versions, or Redis at ``$TRITONGUARD_STATE_URL``): the candidate's share, the
   A/B/n arms, else the primary; ``x-tritonguard-version`` pins a routed version;
6. **breaker and fallback** (``breaker.*``): each version's
   :class:`~tritonguard.rollout.breaker.Breaker`, shared through the state like the guard's; a
   version whose call fails (or answers NaN/Inf) has its rows answered by the primary, counted in
   ``tritonguard_target_errors_total`` and ``tritonguard_fallbacks_total``; an open breaker sends
   its band to the primary;
7. **canary** (``routing.canary_compare``, ``validator.*``): the rows a version under test
   answered are run on the primary in the guard's comparison worker (a thread of the replica) and
   counted in ``tritonguard_compared_total`` by the candidate's judge; each call's time goes to the
   latency log in the state's store (and the canary's paired timings): what ``exporter promote``'s
   gates read besides these metrics;
8. **audit** (``audit.*``): ``reject``, ``quota_reject`` and ``inference`` records.

Not here (Triton guard only): the response cache, goldens at load, shadow traffic, input drift,
cost metering and tracing; their keys fail at start, naming them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import inspect
import json
import logging
import os
import random
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tritonguard.core import repository as repo_mod
from tritonguard.core.config import model_parameters
from tritonguard.core.errors import ConfigError, InvalidInput, TargetError
from tritonguard.core.store import store_url
from tritonguard.core.tensors import ModelSignature, offsets, rows_any
from tritonguard.guard.routing.breakers import Breakers
from tritonguard.guard.routing.comparison import BatchComparator, ComparisonWorker
from tritonguard.guard.routing.config import TASK_TO_WORKLOAD, RoutingConfig
from tritonguard.guard.validation import BatchValidator, ValidationConfig
from tritonguard.hosts.common import (
    HOST_SECTIONS,
    MODEL_FAMILIES,
    Admission,
    HandlerView,
    HostMetrics,
    Refusal,
    Routes,
    StaticStore,
    audit_refusal,
    open_audit,
    parse_sections,
)
from tritonguard.hosts.replica_metrics import ReplicaMetrics, open_board
from tritonguard.privacy.redaction import Redactor
from tritonguard.rollout.breaker import BreakerConfig
from tritonguard.rollout.latency import LatencyRecorder, open_latency_log
from tritonguard.rollout.stores import open_store
from tritonguard.rollout.validators import ValidatorConfig, ValidatorRegistry

log = logging.getLogger(__name__)

SERVED_BY_HEADER = "x-tritonguard-served-by"
VERSION_HEADER = "x-tritonguard-version"
TOP_KEYS = ("target",)
# the canary comparison (what `exporter promote`'s agreement and disagreement gates count) and
# its output-drift trip are the guard's; shadow traffic, goldens and latency ratios are not here
ROUTING_KEYS = ("poll_interval_s", "canary_compare", "compare_queue", "output_drift_alpha", "output_drift_threshold",
                "output_drift_min_rows")
SECTIONS = {**HOST_SECTIONS, "validation": ValidationConfig, "breaker": BreakerConfig, "validator": ValidatorConfig}
# KServe v2 datatype -> numpy
V2_DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
             "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
             "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_}

ModelFn = Callable[[dict[str, np.ndarray]], Any]


@dataclass(kw_only=True)
class ServeConfig:
    """The guard's sections that apply to a model in Ray Serve, under the guard's key names."""

    target: str
    tenancy: Any
    redaction: Any
    audit: Any
    validation: ValidationConfig
    breaker: BreakerConfig
    validator: ValidatorConfig = field(default_factory=ValidatorConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    poll_interval_s: float = 1.0

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any], model: str) -> ServeConfig:
        """``target`` defaults to ``model`` (a model folder served by itself, no guard)."""
        cfg = parse_sections({"target": model, **params}, SECTIONS, model=model, host="Ray Serve deployment",
                             only={"": TOP_KEYS, "routing": ROUTING_KEYS})
        return cls(target=cfg[""].target, tenancy=cfg["tenancy"], redaction=cfg["redaction"], audit=cfg["audit"],
                   validation=cfg["validation"], breaker=cfg["breaker"], validator=cfg["validator"],
                   routing=cfg["routing"], poll_interval_s=cfg["routing"].poll_interval_s)


def settings(model: str, repository: Path | None, config: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters ``model`` is served with. When ``model`` is a guard in ``repository`` (its
    ``config.pbtxt`` has backend ``guard``, or it is the ensemble a guard serves under), its
    ``target`` and those of its keys that apply here come from that config, so the guard's
    configuration serves both hosts; ``config`` overrides them. Otherwise ``model`` is the
    folder of versions itself."""
    found = repo_mod.guard_dir(repository, model) if repository is not None else None
    if found is None:
        return dict(config)
    params = model_parameters(found[1])
    applies = {k: v for k, v in params.items()
               if k == "target" or (k.startswith("routing.") and k.removeprefix("routing.") in ROUTING_KEYS)
               or k.partition(".")[0] in ("tenancy", "redaction", "audit", "validation", "breaker", "validator")}
    return {**applies, **config}


def onnx_version(path: Path, threads: int = 1) -> ModelFn:
    """One version's ``model.onnx`` in an onnxruntime session: inputs by name -> outputs by name."""
    import onnxruntime as ort  # noqa: PLC0415 - only where a version is loaded

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, inputs), strict=True))

    return run


def load_versions(repository: Path, model: str) -> tuple[dict[int, ModelFn], dict[str, Any]]:
    """The complete versions of ``model`` (those with a manifest) as onnxruntime sessions, and its config."""
    model_dir = Path(repository) / model
    if not (model_dir / repo_mod.CONFIG).is_file():
        raise ConfigError(f"model '{model}': no {repo_mod.CONFIG} in {model_dir}")
    config = repo_mod.read_config(model_dir)
    params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
    threads = int(params.get("intra_op_threads") or 1)
    out: dict[int, ModelFn] = {}
    for v in repo_mod.complete_versions(model_dir):
        manifest = model_dir / str(v) / repo_mod.MANIFEST
        artifact = json.loads(manifest.read_text()).get("artifact", "model.onnx") if manifest.is_file() else "model.onnx"
        if not str(artifact).endswith(".onnx"):
            raise ConfigError(f"model '{model}' v{v}: artifact {artifact} is not ONNX (the Ray Serve host loads ONNX)")
        out[v] = onnx_version(model_dir / str(v) / artifact, threads)
    return out, config


def _replica_names() -> tuple[str, str]:
    """(application, replica id) as Ray Serve names them; outside a replica, ("", host:pid)."""
    try:
        ctx = serve.get_replica_context()
        return ctx.app_name, ctx.replica_id.unique_id
    except Exception:  # noqa: BLE001 - built outside Ray Serve (a test, a script)
        return "", f"{socket.gethostname()}-{os.getpid()}"


def _handle_fn(handle: Any) -> ModelFn:
    async def call(inputs: dict[str, np.ndarray]) -> Any:
        return await handle.remote(inputs)
    return call


class _Target:
    """A version as the comparison worker calls it (``infer``, :class:`TargetError` on a failure),
    from its thread: an async version runs on the replica's event loop."""

    def __init__(self, host: GuardedModel, version: int):
        self.host, self.version = host, version

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        fn = self.host.fns.get(self.version)
        if fn is None:
            raise TargetError(f"v{self.version} is not served here", "NOT_FOUND")
        try:
            if self.host._async[self.version]:
                loop = self.host._loop
                if loop is None:
                    raise TargetError("no event loop yet", "UNAVAILABLE")
                out = asyncio.run_coroutine_threadsafe(fn(inputs), loop).result(timeout=60)
            else:
                out = fn(inputs)
            return {k: np.asarray(a) for k, a in out.items()}
        except TargetError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failing version is an error of the comparison
            raise TargetError(f"v{self.version}: {type(exc).__name__}: {exc}") from None


@dataclass
class _Item:
    """One request in a batch, and what the batch decided for it."""

    inputs: dict[str, np.ndarray]
    pin: int | None
    error: InvalidInput | None = None
    version: int = 0
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    failed: str = ""  # the message of a 500: no version could answer


class GuardedModel:
    """The deployment's class (see the module's docstring); built by :func:`guarded`."""

    def __init__(self, model: str, repository: str | None, config: Mapping[str, Any],
                 versions: Mapping[int, Any] | None, state_url: str | None, max_batch_size: int | None,
                 batch_wait_timeout_s: float | None, signature: ModelSignature | None,
                 environ: Mapping[str, str] | None = None):
        self.environ = dict(os.environ if environ is None else environ)
        self.repository = Path(repository) if repository is not None else None
        self.config = cfg = ServeConfig.from_parameters(settings(model, self.repository, config), model)
        # ``name``: the public name (a guard's): rollout state, metrics, audit; ``target``: the
        # folder of versions, as in served-by (the Triton guard's SERVED_BY)
        self.name, self.target = model, cfg.target
        name, target = model, cfg.target
        fns: dict[int, ModelFn] = {}
        model_config: dict[str, Any] = {}
        if self.repository is not None:
            fns, model_config = load_versions(self.repository, target)
        self._model_params = {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
        on_disk = sorted(fns)
        for v, fn in (versions or {}).items():
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"guarded({model!r}): versions must be positive integers, got {v!r}")
            fns[v] = fn if callable(fn) and not hasattr(fn, "remote") else _handle_fn(fn)
        if not fns:
            raise ConfigError(f"guarded({model!r}): no version to serve (no complete version in the repository, "
                              "and no versions= given)")
        self.fns = fns
        self._async = {v: inspect.iscoroutinefunction(fn) for v, fn in fns.items()}
        if signature is None:
            if not model_config:
                raise ConfigError(f"guarded({model!r}): a signature= is needed without a repository")
            signature = ModelSignature.from_config(model_config)
        self.signature = signature
        cfg.validation.check_against(signature, model)
        self.validator = BatchValidator(signature, cfg.validation)
        self._specs = {s.name: s for s in signature.inputs}

        self.registry = CollectorRegistry()
        self.metrics = HostMetrics(name, self.registry, MODEL_FAMILIES)
        self.rng = random.Random()
        url = store_url(state_url, environ=self.environ)
        self.admission = Admission(cfg.tenancy, target=name, metrics=self.metrics, environ=self.environ,
                                   repository=self.repository, url=url, host="ray_serve")
        self.redactor = Redactor(cfg.redaction)
        self.redact_out = self.redactor.active and cfg.redaction.redact_outputs
        # no repository and no state URL: one in-memory state (never a file in the replica's cwd)
        store: Any = (StaticStore(name) if self.repository is None and not url
                      else open_store(name, self.repository or Path("."), url or None))
        # a new state pins the repository's latest version (a version added by versions= gets no
        # traffic until the state routes to it), as the guard pins Triton's latest
        self.view = HandlerView(sorted(fns), guard=name, repo=self.repository or Path("."), target=target,
                                store=store, poll_interval_s=cfg.poll_interval_s, metrics=self.metrics,
                                pin=on_disk[-1] if on_disk else max(fns))
        self.routes = Routes(self.view, sorted(fns), self.metrics, target, f"header '{VERSION_HEADER}'")
        self.breakers = Breakers(guard=name, target=target, config=cfg.breaker, view=self.view,
                                 metrics=self.metrics, alert=self._alert)
        self.view.on_new = self.breakers.follow
        self.breakers.follow(self.view.state, self.view.state)
        for v in fns:
            self.breakers.get(v)
        self.breakers.publish()
        self.routes.publish()
        # what `exporter promote`'s gates read besides the metrics, as the Triton guard keeps it:
        # exact per-call latencies in the state's store, and the canary comparisons (the primary
        # run on the candidate's rows in a worker thread: tritonguard_compared_total, paired timings)
        self.latency: LatencyRecorder | None = None
        if not isinstance(store, StaticStore):
            try:
                self.latency = LatencyRecorder(open_latency_log(name, self.repository or Path("."), url or None))
                self.latency.start()
            except Exception as exc:  # noqa: BLE001 - serving never depends on it; the gate then holds
                log.warning("ray_serve %s: latency samples not kept (%s: %s)", name, type(exc).__name__, exc)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._revision = self.view.state.revision
        self.worker = ComparisonWorker(guard=name, size=cfg.routing.compare_queue, metrics=self.metrics)
        self.comparator = BatchComparator(
            guard=name, target=target, config=cfg.routing, view=self.view, breakers=self.breakers, signals=None,
            target_for=self._target_for, validator_for=self._validator_for,
            registry=ValidatorRegistry.from_config(cfg.validator), output_names=[s.name for s in signature.outputs],
            metrics=self.metrics, latency=self.latency, clock=time.time)
        self.worker.compare = self.comparator.compare
        self.worker.share_breaker = self.breakers.share
        self.worker.start()
        # the application's metrics, not this replica's: Ray's proxy sends a look at the metrics
        # route to any replica, so each publishes its counts to the state's store and the route sums them
        self.shared: ReplicaMetrics | None = None
        if not isinstance(store, StaticStore):
            app, replica = _replica_names()
            try:
                board = open_board(name, app, self.repository or Path("."), url or None)
                self.shared = ReplicaMetrics(self.registry, board, replica,
                                             on_error=lambda: self.metrics.inc("state_errors"))
                self.shared.start()
            except Exception as exc:  # noqa: BLE001 - a store that cannot open: this replica's own counts
                log.warning("ray_serve %s: metrics not shared (%s: %s)", name, type(exc).__name__, exc)
        self.audit, self.audit_key = open_audit(cfg.audit, target=name, repository=self.repository, url=url,
                                                environ=self.environ)
        self._audit_dropped = 0
        self.audit.record("guard_start", model=name, target=target, host="ray_serve", primary=self.routes.primary(),
                          revision=self.view.state.revision, versions=sorted(fns),
                          tenancy=cfg.tenancy.enabled, tenant_auth=cfg.tenancy.auth,
                          quotas=sorted(cfg.tenancy.quotas), redaction=self.redactor.active)
        self._closed = False

        # Triton's dynamic batcher, as Ray Serve's batching: the same limits
        mbs = max_batch_size or max(1, signature.max_batch_size)
        delay_us = int((model_config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds", 0) or 0)
        wait = batch_wait_timeout_s if batch_wait_timeout_s is not None else delay_us / 1e6
        self._batch.set_max_batch_size(mbs)
        self._batch.set_batch_wait_timeout_s(wait)
        self.batching = (mbs, wait)

    def _target_for(self, version: int) -> _Target:
        return _Target(self, version)

    def _validator_for(self, version: int) -> ValidatorConfig:
        """As the guard judges ``version``: the workload its manifest's task names."""
        v = self.config.validator
        if self.repository is None:
            return v
        manifest = repo_mod.read_manifest(self.repository / self.target / str(version)) or {}
        workload = TASK_TO_WORKLOAD.get(manifest.get("task", ""), "")
        return dataclasses.replace(v, workload=workload) if workload and not v.custom and workload != v.workload else v

    def _follow_versions(self) -> None:
        """A version the rollout state names that this replica does not serve yet is loaded from
        the repository, as `exporter promote` loads it on Triton servers: a version exported
        after the deployment is rolled out without deploying again. Checked once per revision."""
        state = self.view.state
        if state.revision == self._revision or self.repository is None:
            return
        self._revision = state.revision
        missing = [v for v in self.view.named_versions() if v not in self.fns]
        if not missing:
            return
        model_dir = self.repository / self.target
        complete = set(repo_mod.complete_versions(model_dir)) if model_dir.is_dir() else set()
        threads = int((self._model_params or {}).get("intra_op_threads") or 1)
        for v in missing:
            if v not in complete:
                continue
            manifest = json.loads((model_dir / str(v) / repo_mod.MANIFEST).read_text())
            artifact = str(manifest.get("artifact", "model.onnx"))
            if not artifact.endswith(".onnx"):
                log.warning("ray_serve %s: v%d is not ONNX (%s): not served here", self.target, v, artifact)
                continue
            try:
                fn = onnx_version(model_dir / str(v) / artifact, threads)
            except Exception as exc:  # noqa: BLE001 - its band goes to the primary, as for any absent version
                log.warning("ray_serve %s: v%d could not be loaded (%s: %s)", self.target, v, type(exc).__name__, exc)
                continue
            self.fns[v], self._async[v] = fn, False
            self.view.handlers = sorted(self.fns)
            self.routes.handlers.add(v)
            with self.breakers.lock:
                self.breakers.get(v)
            log.info("ray_serve %s: v%d loaded from %s", self.target, v, model_dir)

    def _alert(self, event: str, version: int | None, figures: dict[str, Any]) -> None:
        log.warning("ray_serve %s: %s of v%s: %s", self.target, event, version, figures)

    def close(self) -> None:
        """The audit log's writer and the quota managers' files and threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.worker.stop()
        if self.shared is not None:
            self.shared.close()
        if self.latency is not None:
            self.latency.close()
        self.audit.record("guard_stop", model=self.name)
        self.audit.close()
        self.admission.close()

    def __del__(self) -> None:  # Ray Serve calls it when the replica shuts down
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    # -- HTTP -----------------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        if request.method == "GET" and request.url.path.rstrip("/").endswith("/metrics"):
            # the shared page writes and reads the store (a file, or Redis with a 0.5 s timeout):
            # in a thread, so a scrape never stalls the replica's event loop and its batches
            page = await asyncio.to_thread(self.shared.page) if self.shared is not None \
                else generate_latest(self.registry)
            return Response(page, media_type=CONTENT_TYPE_LATEST)
        if request.method != "POST":
            return self._refuse(Refusal(405, "method", "POST KServe v2 JSON to infer"), "")
        m = self.metrics
        m.inc("requests")
        params: dict[str, Any] = {k.lower(): v for k, v in request.headers.items()}
        name = self.config.tenancy.parameter
        for k, v in parse_qsl(request.url.query, keep_blank_values=True):
            if k == name:
                params[name] = v
        tenant, refusal = self.admission.admit(params)
        if refusal is not None:
            return self._refuse(refusal, tenant)
        try:
            return await self._serve(request, params, tenant)
        finally:
            self.admission.release(tenant)
            if self.audit.dropped > self._audit_dropped:
                m.inc("audit_drops", self.audit.dropped - self._audit_dropped)
                self._audit_dropped = self.audit.dropped

    async def _serve(self, request: Request, params: Mapping[str, Any], tenant: str) -> Response:
        body = await request.body()
        hasher = hmac.new(self.audit_key, digestmod=hashlib.sha256) if self.audit_key else hashlib.sha256()
        try:
            inputs = self._decode(body)
        except InvalidInput as err:
            self.metrics.inc("rejects", 1, reason=err.rule)
            return self._refuse(Refusal(400, err.rule, str(err)), tenant)
        redacted = self._redact(inputs, "input", tenant) if self.redactor.active else False
        hasher.update(body)
        pin: int | None = None
        raw = params.get(VERSION_HEADER)
        if raw is not None:
            self.view.refresh(time.time())
            got = self.routes.pinned(raw)
            if isinstance(got, Refusal):
                return self._refuse(got, tenant)
            pin = got
        item: _Item = await self._batch(_Item(inputs, pin))
        if item.error is not None:
            self.metrics.inc("rejects", 1, reason=item.error.rule)
            return self._refuse(Refusal(400, item.error.rule, str(item.error)), tenant)
        served_by = f"{self.target}:{item.version}" if item.version else ""
        if item.failed:
            self._audit_inference(tenant, hasher, served_by, 500, redacted)
            return JSONResponse({"error": item.failed, "rule": "target_error"}, status_code=500)
        redacted_out = self._redact(item.outputs, "output", tenant) if self.redact_out else False
        self.metrics.inc("served", 1, served_by=served_by)
        self._audit_inference(tenant, hasher, served_by, 200, redacted, redacted_out)
        outputs = [{"name": k, "datatype": _v2_type(a), "shape": list(a.shape), "data": _data(a)}
                   for k, a in item.outputs.items()]
        return JSONResponse({"model_name": self.name, "model_version": str(item.version), "outputs": outputs,
                             "parameters": {"served_by": served_by}}, headers={SERVED_BY_HEADER: served_by})

    def _decode(self, body: bytes) -> dict[str, np.ndarray]:
        """KServe v2 JSON -> arrays of the signature's dtypes; structure is judged here, the
        values by the batch's validator."""
        try:
            doc = json.loads(body)
        except ValueError:
            raise InvalidInput("*", "json", "the body is not JSON") from None
        items = doc.get("inputs") if isinstance(doc, dict) else None
        if not isinstance(items, list):
            raise InvalidInput("*", "json", "expected {\"inputs\": [{\"name\", \"shape\", \"datatype\", \"data\"}]}")
        out: dict[str, np.ndarray] = {}
        for t in items:
            name = t.get("name") if isinstance(t, dict) else None
            if not isinstance(name, str):
                raise InvalidInput("*", "json", "every input needs a name")
            spec = self._specs.get(name)
            if spec is None:
                raise InvalidInput(name, "presence", f"no such input (inputs: {', '.join(self._specs)})")
            dt = t.get("datatype", spec.triton_type)
            if dt != spec.triton_type:
                raise InvalidInput(name, "dtype", f"expected {spec.triton_type}, got {dt}")
            try:
                data = t.get("data")
                if spec.is_bytes:
                    arr = np.array([x.encode() if isinstance(x, str) else x for x in np.ravel(np.array(data, dtype=object))],
                                   dtype=object)
                else:
                    arr = np.asarray(data, dtype=spec.dtype)
                shape = t.get("shape")
                arr = arr.reshape(shape) if shape is not None else arr
            except (TypeError, ValueError) as exc:
                raise InvalidInput(name, "shape", f"data does not fit {t.get('shape')}: {exc}") from None
            out[name] = arr
        return out

    def _redact(self, tensors: dict[str, np.ndarray], direction: str, tenant: str) -> bool:
        """The strings of BYTES tensors, redacted in place; whether any was."""
        any_red = False
        for name, arr in tensors.items():
            if arr.dtype != np.object_:
                continue
            texts = [x.decode("utf-8", "surrogateescape") if isinstance(x, bytes) else str(x) for x in arr.flat]
            red, counts = self.redactor.redact_batch(texts)
            if counts:
                any_red = True
                tensors[name] = np.array([r.encode("utf-8", "surrogateescape") for r in red],
                                         dtype=object).reshape(arr.shape)
                for kind, n in counts.items():
                    self.metrics.inc("redactions", n, type=kind, direction=direction,
                                     tenant=self.admission.label(tenant))
        return any_red

    # -- the batch: Triton's dynamic batcher, as Ray Serve batching ------------------------------
    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.0)
    async def _batch(self, items: list[_Item]) -> list[_Item]:
        now = time.time()
        self._loop = asyncio.get_running_loop()
        self.view.refresh(now)
        self._follow_versions()
        self.routes.publish()
        verdict = self.validator.validate([it.inputs for it in items])
        for it, err in zip(items, verdict.errors, strict=True):
            it.error = err
        valid = [items[i] for i in verdict.valid]
        primary = self.routes.primary()
        groups: dict[int, list[int]] = {}
        for pos, it in enumerate(valid):
            v = it.pin if it.pin is not None else self.routes.pick(self.rng.random())
            if v != primary and not self.breakers.get(v).allow(now):
                v = primary  # an open breaker sends its band to the primary
            groups.setdefault(v, []).append(pos)
        sizes = verdict.sizes
        retry: list[int] = []
        for v, idx in groups.items():
            retry += await self._call(v, idx, valid, sizes, primary)
        if retry:
            for pos in retry:
                self.metrics.inc("fallbacks", 1, reason=valid[pos].failed or "error")
                valid[pos].failed = ""
            failed = await self._call(primary, retry, valid, sizes, primary)
            for pos in failed:
                valid[pos].failed = f"no version of '{self.target}' could answer"
                valid[pos].version = primary
        self.breakers.publish()
        return items

    async def _call(self, version: int, idx: list[int], valid: list[_Item], sizes: list[int], primary: int) -> list[int]:
        """Call ``version`` on the fused rows of ``valid[idx]``; the positions it did not answer
        (an error, or NaN/Inf in a request's outputs) are returned for the primary to answer."""
        fused = {name: np.concatenate([valid[i].inputs[name] for i in idx]) if len(idx) > 1 else valid[idx[0]].inputs[name]
                 for name in self._specs}
        starts = offsets([sizes[i] for i in idx])
        n = len(idx)
        fn = self.fns[version]
        t0 = time.perf_counter()
        self.metrics.inc("target_calls")
        try:
            out = await fn(fused) if self._async[version] else fn(fused)
            if inspect.isawaitable(out):
                out = await out
            if not isinstance(out, Mapping):
                raise TypeError(f"the model returned {type(out).__name__}, not a dict of arrays")
            out = {k: np.asarray(a) for k, a in out.items()}
        except Exception as exc:  # noqa: BLE001 - a failing version is counted and fallen back from
            latency = time.perf_counter() - t0
            log.warning("ray_serve %s: v%d failed on %d requests: %s", self.target, version, n, type(exc).__name__)
            self.metrics.inc("target_errors", n, code="INTERNAL", target_version=str(version))
            self._feed(version, n, errors=n, latency_s=latency)
            for i in idx:
                valid[i].failed = "error"
            return list(idx) if version != primary else self._all_failed(idx, valid, version)
        latency = time.perf_counter() - t0
        self.metrics.observe("latency", latency, target_version=str(version))
        if self.latency is not None:
            self.latency.record(version, int(starts[-1]), latency, time.time())
        bad = np.zeros(n, dtype=bool)
        for a in out.values():
            if np.issubdtype(a.dtype, np.floating) and a.shape[:1] == (int(starts[-1]),):
                finite = np.isfinite(a.reshape(len(a), -1)).all(axis=1)
                if not finite.all():
                    bad |= rows_any(~finite, starts)
        self._feed(version, n, non_finite=int(bad.sum()), latency_s=latency)
        back: list[int] = []
        for k, i in enumerate(idx):
            if bad[k] and version != primary:
                valid[i].failed = "non_finite"
                back.append(i)
                continue
            valid[i].version = version
            valid[i].outputs = {name: a[starts[k]:starts[k + 1]] for name, a in out.items()}
        if version != primary and self.config.routing.canary_compare and version in self.view.experiments():
            self._canary(version, primary, fused, out, starts, [k for k in range(n) if not bad[k]])
        return back

    def _canary(self, version: int, primary: int, fused: dict[str, np.ndarray], out: dict[str, np.ndarray],
                starts: np.ndarray, keep: list[int]) -> None:
        """The guard's canary: the rows ``version`` answered (``keep``: the sub-batch's requests
        without NaN/Inf) go to the comparison worker, which runs the primary on them, counts
        ``tritonguard_compared_total`` by the candidate's judge, feeds its breaker and times the pair."""
        if not keep:
            return
        if len(keep) < len(starts) - 1:
            rows = np.concatenate([np.arange(starts[k], starts[k + 1]) for k in keep])
            fused = {k: a[rows] for k, a in fused.items()}
            out = {k: a[rows] if a.shape[:1] == (int(starts[-1]),) else a for k, a in out.items()}
        self.worker.submit(("canary", primary, version, fused, out))

    def _all_failed(self, idx: list[int], valid: list[_Item], version: int) -> list[int]:
        for i in idx:
            valid[i].failed = f"no version of '{self.target}' could answer"
            valid[i].version = version
        return []

    def _feed(self, version: int, n: int, *, errors: int = 0, non_finite: int = 0, latency_s: float) -> None:
        now = time.time()
        with self.breakers.lock:
            b = self.breakers.get(version)
            trip = b.record_batch(now, n, errors=errors, non_finite=non_finite, latency_ms=latency_s * 1000)
            shared = b.to_dict() if trip is not None else None
        if trip is not None:
            self.breakers.tripped(version, trip)
            self.breakers.share(version, shared)

    # -- audit, refusals --------------------------------------------------------------------------
    def _audit_inference(self, tenant: str, hasher: Any, served_by: str, status: int, redacted: bool,
                         redacted_out: bool = False) -> None:
        if self.audit.enabled:
            self.audit.record("inference", tenant=tenant, model=self.name, request=hasher.hexdigest(),
                              served_by=served_by, status=str(status), redacted=redacted, redacted_out=redacted_out)

    def _refuse(self, r: Refusal, tenant: str) -> Response:
        audit_refusal(self.audit, r, tenant, self.name)
        headers = {"retry-after": str(r.retry_after_s)} if r.retry_after_s else {}
        if r.status == 401 and self.config.tenancy.auth == "jwt":
            headers["www-authenticate"] = "Bearer"
        return JSONResponse({"error": r.message, "rule": r.rule}, status_code=r.status, headers=headers)


def _v2_type(a: np.ndarray) -> str:
    if a.dtype == np.object_:
        return "BYTES"
    for name, dt in V2_DTYPES.items():
        if a.dtype == np.dtype(dt):
            return name
    return str(a.dtype).upper()


def _data(a: np.ndarray) -> list[Any]:
    if a.dtype == np.object_:
        return [x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in a.ravel().tolist()]
    return a.ravel().tolist()


def guarded(model: str, *, repository: str | os.PathLike[str] | None = None, config: Mapping[str, Any] | None = None,
            versions: Mapping[int, Any] | None = None, state_url: str | None = None,
            max_batch_size: int | None = None, batch_wait_timeout_s: float | None = None,
            signature: ModelSignature | None = None, num_replicas: int = 1, max_ongoing_requests: int = 64,
            environ: Mapping[str, str] | None = None) -> serve.Application:
    """A Ray Serve application that serves ``model`` behind the guard (see the module's docstring).

    ``config``: the guard's parameters (``tenancy.*``, ``redaction.*``, ``audit.*``, ``validation.*``,
    ``breaker.*``, ``routing.poll_interval_s``; any other fails at start). ``max_ongoing_requests``
    is Ray Serve's: it must exceed the batch size, or batches never fill (Ray's default is 5).
    Each replica keeps its own breaker windows; breaker states are shared through the rollout
    state, quotas through the repository's bucket file or Redis, and the metrics route answers
    every replica's counts summed (through the state's store)."""
    # validated here too, so a bad key fails in the caller's process, not in a replica's log
    ServeConfig.from_parameters(settings(model, None if repository is None else Path(repository), config or {}), model)
    deployment = serve.deployment(GuardedModel, name=f"guard_{model}", num_replicas=num_replicas,
                                  max_ongoing_requests=max_ongoing_requests)
    return deployment.bind(model, None if repository is None else str(Path(repository).resolve()), dict(config or {}),
                           dict(versions or {}), state_url, max_batch_size, batch_wait_timeout_s, signature,
                           None if environ is None else dict(environ))


__all__ = ["GuardedModel", "SERVED_BY_HEADER", "ServeConfig", "VERSION_HEADER", "guarded", "load_versions",
           "onnx_version"]
