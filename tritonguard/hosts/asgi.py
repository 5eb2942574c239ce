"""The guard as ASGI middleware, for a FastAPI / Starlette service that is not behind Triton.

Two lines on an existing app::

    from tritonguard.hosts.asgi import GuardMiddleware
    app.add_middleware(GuardMiddleware, config={"target": "scorer", "tenancy.quotas": {"*": {"rps": 50}}})

(or ``app = GuardMiddleware(app, config=...)``). Pure ASGI, not Starlette's ``BaseHTTPMiddleware``:
a streaming response passes through chunk by chunk, never buffered, and a request's body is read
here only when it is redacted. On each guarded HTTP request, in the guard's order:

1. **admission** (``tenancy.*``, :class:`~tritonguard.privacy.tenancy.auth.TenantResolver`): the
   tenant from the ``tenancy.header`` header or the ``tenancy.parameter`` query parameter, its
   credential when ``tenancy.auth`` asks for one (missing or wrong: 401; valid but naming another
   tenant: 403; a malformed tenant id: 400), then its quota (429 with ``Retry-After``) from the
   same managers the guard uses: per process, shared by the processes of a host through
   ``<repository>/<target>/quota_buckets.bin``, or one quota for the fleet through Redis leases
   when ``$TRITONGUARD_STATE_URL`` (``state_url``) is a ``redis://`` URL;
2. **redaction** (``redaction.*``, :class:`~tritonguard.privacy.redaction.Redactor`): the string
   values of a JSON request body (a ``text/*`` body as one text) before the handler sees them,
   and with ``redaction.redact_outputs`` those of a JSON / ``text/plain`` response body. Other
   bodies (binary, forms, ``text/event-stream`` and other streams, compressed ones) pass as they are;
3. **version routing** (``routing.poll_interval_s``, the rollout state of ``target`` in the same
   store as the guard's: :func:`tritonguard.rollout.stores.open_store`): each request draws
   uniformly in [0, 1); the candidate's share, then the A/B/n arms' bands go to those versions,
   the rest to the primary (``-1``: the highest version registered). ``versions`` maps a
   version to its handler: a path prefix (``{1: "/v1", 2: "/v2"}``: ``/predict`` becomes
   ``/v2/predict`` in the same app) or an ASGI app of its own. The ``x-tritonguard-version``
   request header pins a version the state routes to (the guard's ``version`` parameter);
4. **attribution**: ``x-tritonguard-served-by: <target>:<version>`` on every answer (the guard's
   ``SERVED_BY`` output);
5. **audit** (``audit.*``, :class:`~tritonguard.privacy.audit.log.AuditLog`): ``reject``,
   ``quota_reject`` and ``inference`` records (tenant, a digest of the body as the handler got
   it, who served it, the HTTP status), never blocking;
6. **metrics**: the guard's families under their catalogue names (:mod:`tritonguard.core.catalogue`)
   in a prometheus-client registry, served on ``metrics_path`` (``/metrics``).

Refusals are JSON ``{"error": ..., "rule": ...}`` naming the rule, never a traceback; a handler
that raises before answering becomes a 500 of the same shape (the exception goes to the log).
WebSocket and lifespan traffic passes through; the lifespan's shutdown closes the audit log and
the quota managers (or call :meth:`GuardMiddleware.close`).

The quota, the state and the audit queue are called from the event loop: each is bounded (a
lock, one ``stat`` or one Redis GET per ``poll_interval_s``, the fleet quota's 50 ms socket
timeout on the rare lease that is not taken in the background), as in the guard's execute().
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from tritonguard.core.errors import ConfigError
from tritonguard.core.store import store_url
from tritonguard.hosts.common import (
    HOST_SECTIONS,
    Admission,
    HandlerView,
    HostMetrics,
    Refusal,
    Routes,
    StaticStore,
    audit_refusal,
    error_body,
    open_audit,
    parse_sections,
)
from tritonguard.privacy.audit.log import AuditConfig
from tritonguard.privacy.redaction import RedactionConfig, Redactor
from tritonguard.privacy.tenancy.config import TenancyConfig
from tritonguard.rollout.stores import open_store

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SERVED_BY_HEADER = "x-tritonguard-served-by"
VERSION_HEADER = "x-tritonguard-version"
# the keys of the guard's sections that mean something here; any other fails at start, naming it
TOP_KEYS = ("target",)
ROUTING_KEYS = ("poll_interval_s",)


# -- configuration: the guard's keys and parsers ---------------------------------------------------
@dataclass(kw_only=True)
class HostConfig:
    """The guard's configuration sections that apply to an ASGI service, under the guard's key
    names: ``target`` (the model name the rollout state, metrics, audit and served-by use),
    ``tenancy.*``, ``redaction.*``, ``audit.*`` and ``routing.poll_interval_s``."""

    target: str
    tenancy: TenancyConfig
    redaction: RedactionConfig
    audit: AuditConfig
    poll_interval_s: float = 1.0

    SECTIONS = ("", "tenancy", "redaction", "audit", "routing")

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any], model: str = "asgi") -> HostConfig:
        """``params`` as a guard's config.pbtxt spells them (``"tenancy.quotas": "{...}"``); a
        value may also be a Python object (a dict, a bool, a number), written as JSON here."""
        cfg = parse_sections(params, {s: HOST_SECTIONS[s] for s in cls.SECTIONS}, model=model, host="ASGI middleware",
                             only={"": TOP_KEYS, "routing": ROUTING_KEYS})
        return cls(target=cfg[""].target, tenancy=cfg["tenancy"], redaction=cfg["redaction"], audit=cfg["audit"],
                   poll_interval_s=cfg["routing"].poll_interval_s)


# -- the middleware --------------------------------------------------------------------------------
class GuardMiddleware:
    """The guard around an ASGI app (see the module's docstring). ``config``: the guard's
    parameters (a mapping; ``target`` is required). ``versions``: version -> a path prefix in
    ``app`` or an ASGI app (default: ``app`` itself as version 1). ``paths``: path prefixes
    that are guarded (default every path; the metrics path never is). ``repository``: where the
    file state store, the host's shared quota file and the audit anchors live
    (``<repository>/<target>/``); ``state_url``: a Redis URL (default ``$TRITONGUARD_STATE_URL``)."""

    def __init__(self, app: ASGIApp, config: Mapping[str, Any] | HostConfig, *,
                 versions: Mapping[int, str | ASGIApp] | None = None, paths: tuple[str, ...] = ("/",),
                 repository: str | os.PathLike[str] | None = None, state_url: str | None = None,
                 metrics_path: str | None = "/metrics", registry: CollectorRegistry | None = None,
                 environ: Mapping[str, str] | None = None, rng: random.Random | None = None):
        self.app = app
        self.config = config if isinstance(config, HostConfig) else HostConfig.from_parameters(config)
        cfg, target = self.config, self.config.target
        self.target = target
        self.environ = os.environ if environ is None else environ
        self.handlers: dict[int, str | ASGIApp | None] = dict(versions) if versions else {1: None}
        bad = [v for v in self.handlers if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
        if bad:
            raise ConfigError(f"GuardMiddleware: versions must be positive integers, got {bad!r}")
        self.paths = tuple(paths)
        self.metrics_path = metrics_path
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = HostMetrics(target, self.registry)
        # the children every request touches, looked up once (the label lookup sorts and hashes);
        # a version's are made on its first answer, so no series shows before it has one
        self._requests = self.metrics.child("requests")
        self._served: dict[int, Any] = {}
        self._latency: dict[int, Any] = {}
        self.rng = rng or random.Random()
        self.repository = Path(repository) if repository is not None else None
        url = store_url(state_url, environ=self.environ)

        # admission: the guard's resolver and quota managers
        self.tenancy = cfg.tenancy
        self.admission = Admission(cfg.tenancy, target=target, metrics=self.metrics, environ=self.environ,
                                   repository=self.repository, url=url, host="asgi")
        self.resolver, self.quotas, self.label = self.admission.resolver, self.admission.quotas, self.admission.label
        # redaction
        self.redactor = Redactor(cfg.redaction)
        self.redact_in = self.redactor.active
        self.redact_out = self.redactor.active and cfg.redaction.redact_outputs
        self.model_sees_redacted = cfg.redaction.model_sees_redacted
        # routing: the rollout state of ``target``, read like the guard reads it
        if self.repository is None and not url:
            store: Any = StaticStore(target)
        else:
            store = open_store(target, self.repository or Path("."), url or None)
        self.view = HandlerView(list(self.handlers), guard=target, repo=self.repository or Path("."), target=target,
                                store=store, poll_interval_s=cfg.poll_interval_s, metrics=self.metrics,
                                pin=max(self.handlers))
        self.routes = Routes(self.view, list(self.handlers), self.metrics, target, f"header '{VERSION_HEADER}'")
        self.routes.publish()
        # audit: one writer per file ("{pid}" in audit.path gives each worker process its own)
        self.audit, self.audit_key = open_audit(cfg.audit, target=target, repository=self.repository, url=url,
                                                environ=self.environ)
        self._audit_dropped = 0
        self.audit.record("guard_start", model=target, host="asgi", primary=self.routes.primary(),
                          revision=self.view.state.revision, versions=sorted(self.handlers),
                          tenancy=cfg.tenancy.enabled, tenant_auth=cfg.tenancy.auth,
                          quotas=sorted(cfg.tenancy.quotas), redaction=self.redact_in or self.redact_out)
        self._closed = False

    def close(self) -> None:
        """The audit log's writer and the quota managers' files and threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.audit.record("guard_stop", model=self.target)
        self.audit.close()
        self.admission.close()

    # -- routing ---------------------------------------------------------------------------------
    def pick(self, draw: float) -> int:
        """The version a request with uniform draw ``draw`` goes to (:meth:`Routes.pick`)."""
        return self.routes.pick(draw)

    # -- admission -------------------------------------------------------------------------------
    def _params(self, scope: Scope) -> dict[str, Any]:
        params: dict[str, Any] = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        qs: bytes = scope.get("query_string", b"")
        name = self.tenancy.parameter
        if qs and name.encode() in qs:
            for k, v in parse_qsl(qs.decode("latin-1"), keep_blank_values=True):
                if k == name:
                    params[name] = v
        return params

    # -- ASGI --------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self.app(scope, receive, self._lifespan_send(send))
            return
        if kind != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if self.metrics_path is not None and path == self.metrics_path:
            await _respond(send, 200, generate_latest(self.registry), [(b"content-type", CONTENT_TYPE_LATEST.encode())])
            return
        if not path.startswith(self.paths):
            await self.app(scope, receive, send)
            return
        await self._guarded(scope, receive, send)

    def _lifespan_send(self, send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                self.close()
            await send(message)
        return wrapped

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = self.metrics
        self._requests.inc()
        params = self._params(scope)
        tenant, refusal = self.admission.admit(params)
        if refusal is not None:
            await self._refuse(send, refusal, tenant)
            return
        try:
            await self._serve(scope, receive, send, tenant, params)
        finally:
            self.admission.release(tenant)
            if self.audit.dropped > self._audit_dropped:
                m.inc("audit_drops", self.audit.dropped - self._audit_dropped)
                self._audit_dropped = self.audit.dropped

    async def _serve(self, scope: Scope, receive: Receive, send: Send, tenant: str, params: Mapping[str, Any]) -> None:
        m, target = self.metrics, self.target
        self.view.refresh(time.monotonic())
        self.routes.publish()
        pin = params.get(VERSION_HEADER)
        if pin is not None:
            version = self.routes.pinned(pin)
            if isinstance(version, Refusal):
                await self._refuse(send, version, tenant)
                return
        else:
            version = self.pick(self.rng.random())
        served_by = f"{target}:{version}"

        # the request body: read here only when it is redacted (JSON or text); else streamed
        redacted_in = False
        hasher = hmac.new(self.audit_key, digestmod=hashlib.sha256) if self.audit_key else hashlib.sha256()
        kind = _kind(scope.get("headers", ()))
        if self.redact_in and kind in ("json", "text"):
            body, more = await _read_body(receive)
            red, counts = self._redact(body, kind)
            redacted_in = bool(counts)
            self._count(counts, "input", tenant)
            hasher.update(red)
            if redacted_in and self.model_sees_redacted:
                scope = dict(scope, headers=_with_length(scope.get("headers", ()), len(red)))
                body = red
            receive = _replay(body, receive, more)
        elif self.audit.enabled:
            receive = _hashing(receive, hasher)

        # the handler for ``version``
        handler = self.handlers[version]
        app = self.app
        if isinstance(handler, str):
            scope = dict(scope, path=handler.rstrip("/") + scope["path"])
            if "raw_path" in scope and scope["raw_path"] is not None:
                scope["raw_path"] = handler.rstrip("/").encode() + scope["raw_path"]
        elif handler is not None:
            app = handler

        state = _Answer()
        out = self._sender(send, served_by, version, tenant, state)
        start = time.perf_counter()
        state.start = start
        try:
            await app(scope, receive, out)
        except Exception:  # noqa: BLE001 - a handler's failure is a 500 of our shape, never a traceback
            log.exception("asgi %s: the handler of v%d failed", target, version)
            m.inc("target_errors", 1, code="INTERNAL", target_version=str(version))
            if not state.started:
                state.status = 500
                await _respond(send, 500, error_body("the handler failed", "target_error"),
                               [(b"content-type", b"application/json"), (SERVED_BY_HEADER.encode(), served_by.encode())])
            self._audit_inference(tenant, hasher, served_by, state.status or 500, redacted_in, state.redacted_out)
            return
        if state.status >= 500:
            m.inc("target_errors", 1, code=f"HTTP_{state.status}", target_version=str(version))
        elif state.status:
            served = self._served.get(version)
            if served is None:
                served = self._served[version] = m.child("served", served_by=served_by)
            served.inc()
        self._audit_inference(tenant, hasher, served_by, state.status, redacted_in, state.redacted_out)

    def _sender(self, send: Send, served_by: str, version: int, tenant: str, state: _Answer) -> Send:
        header = (SERVED_BY_HEADER.encode(), served_by.encode())
        redact_out, children = self.redact_out, self._latency

        async def wrapped(message: Message) -> None:
            t = message["type"]
            if t == "http.response.start":
                state.status = message["status"]
                headers = [*message.get("headers", ()), header]
                message = dict(message, headers=headers)
                kind = _kind(headers, response=True) if redact_out else None
                if kind in ("json", "text"):
                    state.held, state.kind = message, kind  # sent with the redacted body
                    return
                state.started = True
                latency = children.get(version) or self._latency_child(version)
                latency.observe(time.perf_counter() - state.start)
                await send(message)
            elif t == "http.response.body" and state.held is not None:
                state.chunks.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                body = b"".join(state.chunks)
                red, counts = self._redact(body, state.kind)
                self._count(counts, "output", tenant)
                state.redacted_out = bool(counts)
                start = dict(state.held, headers=_with_length(state.held["headers"], len(red)))
                state.held, state.chunks, state.started = None, [], True
                latency = children.get(version) or self._latency_child(version)
                latency.observe(time.perf_counter() - state.start)
                await send(start)
                await send({"type": "http.response.body", "body": red, "more_body": False})
            else:
                await send(message)

        return wrapped

    def _latency_child(self, version: int) -> Any:
        child = self._latency[version] = self.metrics.child("latency", target_version=str(version))
        return child

    # -- redaction, audit, refusals -------------------------------------------------------------
    def _redact(self, body: bytes, kind: str | None) -> tuple[bytes, dict[str, int]]:
        """The body with PII replaced: a JSON document's string values (keys stay), or a text as a
        whole; a body that is not valid JSON / UTF-8 is redacted as text (surrogates kept)."""
        if not body:
            return body, {}
        text = body.decode("utf-8", "surrogateescape")
        if kind == "json":
            try:
                doc = json.loads(text)
            except ValueError:
                doc = _NOT_JSON
            if doc is not _NOT_JSON:
                strings: list[str] = []
                _collect(doc, strings)
                if not strings:
                    return body, {}
                red, counts = self.redactor.redact_batch(strings)
                if not counts:
                    return body, counts
                it = iter(red)
                return json.dumps(_rebuild(doc, it), ensure_ascii=False).encode("utf-8"), counts
        red, counts = self.redactor.redact_batch([text])
        return (red[0].encode("utf-8", "surrogateescape") if counts else body), counts

    def _count(self, counts: Mapping[str, int], direction: str, tenant: str) -> None:
        for kind, n in counts.items():
            self.metrics.inc("redactions", n, type=kind, direction=direction, tenant=self.label(tenant))

    def _audit_inference(self, tenant: str, hasher: Any, served_by: str, status: int, redacted_in: bool,
                         redacted_out: bool) -> None:
        if self.audit.enabled:
            self.audit.record("inference", tenant=tenant, model=self.target, request=hasher.hexdigest(),
                              served_by=served_by, status=str(status), redacted=redacted_in,
                              redacted_out=redacted_out)

    async def _refuse(self, send: Send, r: Refusal, tenant: str) -> None:
        audit_refusal(self.audit, r, tenant, self.target)
        headers = [(b"content-type", b"application/json")]
        if r.retry_after_s:
            headers.append((b"retry-after", str(r.retry_after_s).encode()))
        if r.status == 401 and self.tenancy.auth == "jwt":
            headers.append((b"www-authenticate", b"Bearer"))
        await _respond(send, r.status, error_body(r.message, r.rule), headers)


# -- small ASGI helpers ----------------------------------------------------------------------------
_NOT_JSON = object()


@dataclass
class _Answer:
    """What one request's handler has answered so far."""

    status: int = 0
    started: bool = False
    start: float = 0.0
    held: Message | None = None
    kind: str | None = None
    chunks: list[bytes] = dataclasses.field(default_factory=list)
    redacted_out: bool = False


def _kind(headers: Any, *, response: bool = False) -> str | None:
    """"json" or "text" for a body redaction reads; None for every other (and any compressed) body.
    A response's ``text/event-stream`` is a stream: never buffered."""
    ctype, encoded = b"", False
    for k, v in headers:
        lk = k.lower()
        if lk == b"content-type":
            ctype = v.lower()
        elif lk == b"content-encoding" and v.lower() not in (b"identity", b""):
            encoded = True
    if encoded:
        return None
    mime = ctype.split(b";", 1)[0].strip()
    if mime == b"application/json" or mime.endswith(b"+json"):
        return "json"
    if mime.startswith(b"text/") and mime != b"text/event-stream" and (not response or mime == b"text/plain"):
        return "text"
    return None


def _collect(obj: Any, out: list[str]) -> None:
    if isinstance(obj, str):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _collect(v, out)


def _rebuild(obj: Any, it: Any) -> Any:
    if isinstance(obj, str):
        return next(it)
    if isinstance(obj, dict):
        return {k: _rebuild(v, it) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, it) for v in obj]
    return obj


def _with_length(headers: Any, n: int) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    out.append((b"content-length", str(n).encode()))
    return out


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The whole request body, and whether the client is still there."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), False
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), True


def _replay(body: bytes, receive: Receive, connected: bool) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if not connected:
            return {"type": "http.disconnect"}
        return await receive()

    return replay


def _hashing(receive: Receive, hasher: Any) -> Receive:
    async def hashing() -> Message:
        message = await receive()
        if message["type"] == "http.request":
            hasher.update(message.get("body", b""))
        return message

    return hashing


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


__all__ = ["GuardMiddleware", "HostConfig", "HostMetrics", "SERVED_BY_HEADER", "VERSION_HEADER"]
