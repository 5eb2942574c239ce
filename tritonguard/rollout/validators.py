"""Workload validators: compare a candidate's outputs with a reference's, row by row.

A validator returns a :class:`Verdict` whose ``per_row`` holds one status per request row: the
canary compares request by request, and the breaker counts FAILs over compared requests. The
batch status is the worst row's. Built-ins cover classifier, embedding, regression/encoder,
reranker and generation outputs; a deployment can override one per workload
(:class:`ValidatorRegistry`) or name its own (``validator.custom = "pkg.mod:fn"``). A validator
that raises yields a FAIL verdict, never an exception in the serving path.

:class:`AlertDispatcher` hands events to callables and an optional webhook on a daemon thread
behind a bounded queue, so alerting can never block or fail a request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import json
import logging
import os.path
import queue
import threading
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tritonguard.core.errors import ConfigError

log = logging.getLogger(__name__)

PASS, MARGINAL, FAIL = "PASS", "MARGINAL", "FAIL"
STATUSES = (PASS, MARGINAL, FAIL)
_RANK = {PASS: 0, MARGINAL: 1, FAIL: 2}

# (atol, rtol) per output dtype; integers compare exactly
DTYPE_TOLERANCE = {"float64": (1e-4, 1e-4), "float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2),
                   "bfloat16": (3e-2, 3e-2)}


@dataclass(kw_only=True)
class ValidatorConfig:
    """``validator.*`` parameters of a guard model."""

    workload: str = "classifier"
    output: str = ""  # output tensor to compare; "" = the only (or first) one
    atol: float = -1.0  # < 0: from the output dtype (DTYPE_TOLERANCE)
    rtol: float = -1.0
    marginal_factor: float = 10.0  # MARGINAL up to this many tolerances
    cosine_pass: float = 0.999
    cosine_marginal: float = 0.99
    spearman_pass: float = 0.99
    spearman_marginal: float = 0.9
    prefix_marginal: float = 0.9  # generation: MARGINAL when the common prefix covers this much
    custom: str = ""  # "package.module:callable"

    def __post_init__(self) -> None:
        if not self.custom and self.workload not in BUILTINS:
            raise ValueError(f"validator.workload {self.workload!r} is not built in "
                             f"({', '.join(sorted(BUILTINS))}); set validator.custom for others")
        if self.custom and ":" not in self.custom:
            raise ValueError(f"validator.custom must be 'package.module:callable', got {self.custom!r}")
        if self.marginal_factor < 1:
            raise ValueError("validator.marginal_factor must be >= 1")
        for lo, hi in (("cosine_marginal", "cosine_pass"), ("spearman_marginal", "spearman_pass")):
            if not -1.0 <= getattr(self, lo) <= getattr(self, hi) <= 1.0:
                raise ValueError(f"validator.{lo} <= validator.{hi} must both lie in [-1, 1]")
        if not 0.0 <= self.prefix_marginal <= 1.0:
            raise ValueError("validator.prefix_marginal must be in [0, 1]")

    def tolerance(self, *dtypes: Any) -> tuple[float, float]:
        """(atol, rtol): configured, else the loosest of the dtypes'; (0, 0) for integers."""
        atol = rtol = 0.0
        for dt in dtypes:
            try:
                name = np.dtype(dt).name
            except TypeError:  # "bfloat16" without ml_dtypes installed
                name = str(dt)
            a, r = DTYPE_TOLERANCE.get(name, (0.0, 0.0))
            atol, rtol = max(atol, a), max(rtol, r)
        return (self.atol if self.atol >= 0 else atol, self.rtol if self.rtol >= 0 else rtol)


@dataclass
class Verdict:
    status: str
    metrics: dict[str, Any]
    per_row: np.ndarray  # one status string per row

    @classmethod
    def from_rows(cls, per_row: np.ndarray, metrics: dict[str, Any]) -> Verdict:
        per_row = np.asarray(per_row, dtype="<U8")
        status = PASS
        if (per_row == FAIL).any():
            status = FAIL
        elif (per_row == MARGINAL).any():
            status = MARGINAL
        return cls(status, {"rows": int(per_row.size), **metrics}, per_row)

    @property
    def fail_rate(self) -> float:
        return float((self.per_row == FAIL).mean()) if self.per_row.size else 0.0


def _grade(pass_mask: np.ndarray, marginal_mask: np.ndarray) -> np.ndarray:
    return np.where(pass_mask, PASS, np.where(marginal_mask, MARGINAL, FAIL)).astype("<U8")


def _rows(a: Any) -> np.ndarray:
    a = np.asarray(a)
    return a.reshape(len(a), -1) if a.ndim else a.reshape(1, 1)


# -- built-ins -------------------------------------------------------------------------------
def classifier(candidate: Any, reference: Any, config: ValidatorConfig) -> Verdict:
    """Top-1 agreement per row, and the largest probability difference."""
    c, r = _rows(candidate), _rows(reference)
    atol, _ = config.tolerance(c.dtype, r.dtype)
    agree = c.argmax(axis=1) == r.argmax(axis=1)
    with np.errstate(invalid="ignore"):
        diff = np.abs(c.astype(np.float64) - r).max(axis=1)
    diff = np.where(np.isnan(diff), np.inf, diff)
    per_row = _grade(agree & (diff <= atol), agree & (diff <= config.marginal_factor * atol))
    return Verdict.from_rows(per_row, {"agreement": float(agree.mean()) if agree.size else 1.0,
                                       "max_abs_diff": float(diff.max()) if diff.size else 0.0,
                                       "atol": atol})


def row_cosine(candidate: Any, reference: Any) -> np.ndarray:
    """Cosine similarity per row in float64: two zero vectors agree (1), one zero vector or a
    NaN/Inf row does not (0)."""
    c, r = _rows(candidate).astype(np.float64), _rows(reference).astype(np.float64)
    nc, nr = np.linalg.norm(c, axis=1), np.linalg.norm(r, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.einsum("ij,ij->i", c, r) / (nc * nr)
    cos = np.where((nc == 0) & (nr == 0), 1.0, cos)
    return np.nan_to_num(cos, nan=0.0)


def embedding(candidate: Any, reference: Any, config: ValidatorConfig) -> Verdict:
    """Cosine similarity per row (:func:`row_cosine`)."""
    cos = row_cosine(candidate, reference)
    per_row = _grade(cos >= config.cosine_pass, cos >= config.cosine_marginal)
    return Verdict.from_rows(per_row, {"min_cosine": float(cos.min()) if cos.size else 1.0,
                                       "mean_cosine": float(cos.mean()) if cos.size else 1.0})


def regression(candidate: Any, reference: Any, config: ValidatorConfig) -> Verdict:
    """Element-wise ``|c - r| <= atol + rtol * |r|`` with dtype-aware tolerances; ints exact."""
    c, r = _rows(candidate), _rows(reference)
    if c.shape != r.shape:
        return Verdict.from_rows(np.full(len(r), FAIL), {"error": f"shape {c.shape} != reference {r.shape}"})
    atol, rtol = config.tolerance(c.dtype, r.dtype)
    c64, r64 = c.astype(np.float64), r.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.abs(c64 - r64)
        same = (c64 == r64) | (np.isnan(c64) & np.isnan(r64))  # NaN where the reference has NaN
        ratio = np.where(same, 0.0, err / (atol + rtol * np.abs(r64)))
    ratio = np.nan_to_num(ratio, nan=np.inf)
    worst = ratio.max(axis=1) if ratio.shape[1] else np.zeros(len(ratio))
    per_row = _grade(worst <= 1.0, worst <= config.marginal_factor)
    finite = np.where(same, 0.0, np.nan_to_num(err, nan=np.inf))
    return Verdict.from_rows(per_row, {"max_abs_diff": float(finite.max()) if finite.size else 0.0,
                                       "max_tolerance_ratio": float(worst.max()) if worst.size else 0.0,
                                       "atol": atol, "rtol": rtol})


def _row_spearman(c: np.ndarray, r: np.ndarray) -> np.ndarray:
    from scipy import stats  # noqa: PLC0415 - defers scipy (seconds to import) to its first use

    rc = stats.rankdata(c, axis=1)
    rr = stats.rankdata(r, axis=1)
    rc -= rc.mean(axis=1, keepdims=True)
    rr -= rr.mean(axis=1, keepdims=True)
    den = np.sqrt((rc * rc).sum(axis=1) * (rr * rr).sum(axis=1))
    num = (rc * rr).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = num / den
    # a constant row has no ranking: equal to another constant row, unrelated to anything else
    const = ((rc == 0).all(axis=1), (rr == 0).all(axis=1))
    return np.where(const[0] & const[1], 1.0, np.where(const[0] | const[1], 0.0, rho))


def reranker(candidate: Any, reference: Any, config: ValidatorConfig) -> Verdict:
    """Spearman rank correlation of the scores per row."""
    c, r = _rows(candidate).astype(np.float64), _rows(reference).astype(np.float64)
    if c.shape != r.shape:
        return Verdict.from_rows(np.full(len(r), FAIL), {"error": f"shape {c.shape} != reference {r.shape}"})
    bad = ~(np.isfinite(c).all(axis=1) & np.isfinite(r).all(axis=1))
    rho = np.where(bad, -1.0, _row_spearman(np.nan_to_num(c), np.nan_to_num(r)))
    per_row = _grade(rho >= config.spearman_pass, rho >= config.spearman_marginal)
    return Verdict.from_rows(per_row, {"min_spearman": float(rho.min()) if rho.size else 1.0,
                                       "mean_spearman": float(rho.mean()) if rho.size else 1.0})


def _text(x: Any) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


def generation(candidate: Any, reference: Any, config: ValidatorConfig) -> Verdict:
    """Exact match per row; MARGINAL when the common prefix covers ``prefix_marginal`` of the text."""
    c, r = np.asarray(candidate, dtype=object), np.asarray(reference, dtype=object)
    c = c.reshape(len(c), -1) if c.ndim else c.reshape(1, 1)
    r = r.reshape(len(r), -1) if r.ndim else r.reshape(1, 1)
    n = len(r)
    exact = np.zeros(n, dtype=bool)
    prefix = np.zeros(n)
    for i in range(n):  # strings: per row, there is no vector form
        a = "\x00".join(_text(x) for x in c[i]) if i < len(c) else ""
        b = "\x00".join(_text(x) for x in r[i])
        exact[i] = a == b
        longest = max(len(a), len(b))
        common = len(_common_prefix(a, b))
        prefix[i] = 1.0 if longest == 0 else common / longest
    per_row = _grade(exact, prefix >= config.prefix_marginal)
    return Verdict.from_rows(per_row, {"exact_match_rate": float(exact.mean()) if n else 1.0,
                                       "prefix_match_rate": float(prefix.mean()) if n else 1.0})


def _common_prefix(a: str, b: str) -> str:
    return os.path.commonprefix([a, b])


BUILTINS: dict[str, Callable[..., Any]] = {
    "classifier": classifier,
    "embedding": embedding,
    "regression": regression,
    "encoder": regression,
    "reranker": reranker,
    "generation": generation,
}


# -- custom validators -----------------------------------------------------------------------
def load_callable(path: str) -> Callable[..., Any]:
    """``"package.module:callable"`` -> the callable; :class:`ConfigError` saying what is wrong."""
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(f"callable path {path!r} must be 'package.module:callable'")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ConfigError(f"callable path {path!r}: cannot import module {mod_name!r}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"callable path {path!r}: module {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"callable path {path!r}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


_local = threading.local()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _run_coroutine(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        # no loop in this thread: a private one, kept per thread so each call does not pay for a new loop
        loop = getattr(_local, "loop", None)
        if loop is None or loop.is_closed():
            loop = _local.loop = asyncio.new_event_loop()
        return loop.run_until_complete(coro)
    # called from inside a running loop (an async execute): it cannot be re-entered, use a worker
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tritonguard-validator")
    return _pool.submit(asyncio.run, coro).result()


def _select(outputs: Any, name: str) -> Any:
    if not isinstance(outputs, Mapping):
        return outputs
    if name:
        return outputs[name]
    return next(iter(outputs.values()))


def _n_rows(reference: Any, name: str) -> int:
    try:
        ref = np.asarray(_select(reference, name), dtype=object)
        return len(ref) if ref.ndim else 1
    except Exception:  # noqa: BLE001 - only used to shape a FAIL verdict
        return 0


def run_validator(fn: Callable[..., Any], candidate: Any, reference: Any, config: ValidatorConfig) -> Verdict:
    """Call ``fn`` (sync or async); normalise its result; any failure is a FAIL verdict."""
    try:
        # built-ins compare one output; custom callables get what was passed, e.g. all outputs
        if fn in BUILTINS.values():
            result = fn(_select(candidate, config.output), _select(reference, config.output), config)
        else:
            result = fn(candidate, reference, config)
        if inspect.isawaitable(result):
            result = _run_coroutine(result)
        if isinstance(result, Verdict):
            if result.status not in STATUSES:
                raise ValueError(f"status {result.status!r} is not one of {', '.join(STATUSES)}")
            return result
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
            status, metrics = result
            if status not in STATUSES:
                raise ValueError(f"status {status!r} is not one of {', '.join(STATUSES)}")
            return Verdict(status, dict(metrics), np.full(_n_rows(reference, config.output), status, dtype="<U8"))
        raise TypeError(f"validator returned {type(result).__name__}, expected a Verdict or (status, metrics)")
    except Exception as exc:  # noqa: BLE001 - a broken validator must fail the comparison, not the request
        log.warning("validator %s failed: %s: %s", getattr(fn, "__name__", fn), type(exc).__name__, exc)
        return Verdict(FAIL, {"error": f"{type(exc).__name__}: {exc}"},
                       np.full(_n_rows(reference, config.output), FAIL, dtype="<U8"))


class ValidatorRegistry:
    """Validators by workload: built-ins, overridden per workload by :meth:`register`."""

    def __init__(self) -> None:
        self._overrides: dict[str, Callable[..., Any]] = {}

    @classmethod
    def from_config(cls, config: ValidatorConfig) -> ValidatorRegistry:
        reg = cls()
        if config.custom:
            reg.register(config.workload, load_callable(config.custom))
        return reg

    def register(self, workload: str, fn: Callable[..., Any]) -> None:
        if not callable(fn):
            raise TypeError(f"validator for {workload!r} is not callable")
        self._overrides[workload] = fn

    def unregister(self, workload: str) -> None:
        self._overrides.pop(workload, None)

    def get(self, workload: str) -> Callable[..., Any]:
        fn = self._overrides.get(workload) or BUILTINS.get(workload)
        if fn is None:
            raise KeyError(f"no validator for workload {workload!r}")
        return fn

    def workloads(self) -> list[str]:
        return sorted(set(BUILTINS) | set(self._overrides))

    def validate(self, candidate: Any, reference: Any, config: ValidatorConfig) -> Verdict:
        """Run the validator of ``config.workload``; never raises."""
        try:
            fn = self.get(config.workload)
        except KeyError as exc:
            return Verdict(FAIL, {"error": f"KeyError: {exc}"},
                           np.full(_n_rows(reference, config.output), FAIL, dtype="<U8"))
        return run_validator(fn, candidate, reference, config)


# -- alerts ----------------------------------------------------------------------------------
class AlertDispatcher:
    """Fire-and-forget alerts: a bounded queue drained by one daemon thread."""

    def __init__(self, callables: Iterable[Callable[[dict], Any]] = (), webhook_url: str = "", *,
                 queue_size: int = 1000, timeout_s: float = 2.0):
        self.callables = list(callables)
        self.webhook_url = webhook_url
        self.timeout_s = timeout_s
        self.failures = 0
        self.dropped = 0
        self.sent = 0
        self._queue: queue.Queue[dict] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def fire(self, event: dict[str, Any]) -> bool:
        """Queue ``event``; False (and counted in ``dropped``) when the queue is full."""
        self._ensure_thread()
        try:
            self._queue.put_nowait(dict(event))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued event was handled (for tests and shutdown)."""
        q = self._queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)

    def _ensure_thread(self) -> None:
        # started on first use, so a dispatcher built before a fork gets its thread in the child
        if self._thread is not None and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tritonguard-alerts", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            try:
                self._deliver(event)
            finally:
                self._queue.task_done()

    def _deliver(self, event: dict[str, Any]) -> None:
        for fn in self.callables:
            try:
                result = fn(event)
                if inspect.isawaitable(result):
                    _run_coroutine(result)
            except Exception as exc:  # noqa: BLE001 - alerting must never fail serving
                self.failures += 1
                log.warning("alert callback %s failed: %s: %s", getattr(fn, "__name__", fn), type(exc).__name__, exc)
        if self.webhook_url:
            body = json.dumps(event, default=str).encode()
            req = urllib.request.Request(self.webhook_url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    resp.read()
            except Exception as exc:  # noqa: BLE001 - HTTP errors, timeouts, refused connections
                self.failures += 1
                log.warning("alert webhook %s failed: %s: %s", self.webhook_url, type(exc).__name__, exc)
                return
        self.sent += 1
