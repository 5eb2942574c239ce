"""Sending a block's rows through the guard over gRPC (:class:`Scorer`): requests of
``batch_rows`` round-robin over the servers, a rejected request bisected until the rejected
rows stand alone, transient errors retried with backoff and full jitter.
"""

from __future__ import annotations

import itertools
import random
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from exporter.batch.job import SERVED_BY, BatchError, Job, np_dtype

# transient: the job slows down and retries (quota 503s, a restarting server, a model loading)
RETRYABLE = {"StatusCode.UNAVAILABLE", "StatusCode.RESOURCE_EXHAUSTED", "StatusCode.DEADLINE_EXCEEDED",
             "StatusCode.ABORTED", "StatusCode.NOT_FOUND", "StatusCode.CANCELLED"}
REJECTED = {"StatusCode.INVALID_ARGUMENT", "StatusCode.OUT_OF_RANGE", "StatusCode.FAILED_PRECONDITION"}
INTERNAL_ATTEMPTS = 3  # an INTERNAL answer is retried this often before the rows are bisected
_RETRY_AFTER = re.compile(r"retry after (\d+) ms")
_RULE = re.compile(r"violates (\w+)")


# -- sending ---------------------------------------------------------------------------------

class Scorer:
    """Sends a block's rows through the guard: requests of ``batch_rows``, round-robin over the
    servers, ``concurrency`` in flight per server. A rejected request is bisected until the
    rejected rows stand alone; transient errors are retried with backoff and full jitter."""

    def __init__(self, job: Job, sleep: Callable[[float], None] = time.sleep,
                 on_rows: Callable[[int], None] | None = None):
        import tritonclient.grpc as grpcclient  # noqa: PLC0415 - defers a heavy import

        self.job, self.sleep, self.on_rows = job, sleep, on_rows
        self.grpc = grpcclient
        self.clients = [grpcclient.InferenceServerClient(url) for url in job.servers]
        self._next = itertools.cycle(range(len(self.clients)))
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=job.concurrency * len(self.clients), thread_name_prefix="batch")
        self.params: dict[str, Any] = {}
        if job.tenant:
            self.params["tenant"] = job.tenant
        if job.version is not None:
            # the guard answers with this version only (no fallback), or fails the request
            self.params["version"] = job.version
        self.headers = dict(job.headers) or None

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for c in self.clients:
            c.close()

    def score(self, tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray, dict[int, tuple[str, str]]]:
        """Outputs and SERVED_BY (bytes) of the rows that were served (in row order), and the
        rejected rows (index into ``tensors``) with (rule, message)."""
        n = len(next(iter(tensors.values()))) if tensors else 0
        step = self.job.batch_rows
        futures = [self.pool.submit(self._range, tensors, lo, min(lo + step, n)) for lo in range(0, n, step)]
        outs: dict[str, list[np.ndarray]] = {o.name: [] for o in self.job.outputs}
        served: list[np.ndarray] = []
        bad: dict[int, tuple[str, str]] = {}
        for f in futures:
            for lo, _hi, result in f.result():
                if isinstance(result, tuple):
                    bad[lo] = result
                    continue
                for o in self.job.outputs:
                    outs[o.name].append(result[o.name])
                served.append(result[SERVED_BY])
        empty = {o.name: np.empty((0, *o.dims), dtype=np_dtype(o.datatype) or object) for o in self.job.outputs}
        by = np.concatenate(served) if served else np.empty(0, dtype=object)
        return {o: np.concatenate(v) if v else empty[o] for o, v in outs.items()}, by, bad

    def _range(self, tensors: dict[str, np.ndarray], lo: int, hi: int) -> list[tuple[int, int, Any]]:
        """[lo, hi) as one request, or bisected while the guard rejects it."""
        try:
            answer = [(lo, hi, self._infer({k: v[lo:hi] for k, v in tensors.items()}))]
        except _Rejected as exc:
            if hi - lo == 1:
                if self.on_rows is not None:
                    self.on_rows(1)
                return [(lo, hi, (exc.rule, exc.message))]
        else:
            if self.on_rows is not None:
                self.on_rows(hi - lo)
            return answer
        mid = (lo + hi) // 2
        return self._range(tensors, lo, mid) + self._range(tensors, mid, hi)

    def _client(self) -> Any:
        with self._lock:
            return self.clients[next(self._next)]

    def _infer(self, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
        g = self.grpc
        inputs = []
        for s in self.job.inputs:
            x = tensors[s.name]
            inp = g.InferInput(s.name, list(x.shape), s.datatype)
            inp.set_data_from_numpy(x)
            inputs.append(inp)
        outputs = [g.InferRequestedOutput(o) for o in (*(o.name for o in self.job.outputs), SERVED_BY)]
        started, attempt, internal = time.monotonic(), 0, 0
        while True:
            client = self._client()
            try:
                res = client.infer(self.job.model, inputs, outputs=outputs, headers=self.headers,
                                   parameters=self.params or None)
            except g.InferenceServerException as exc:
                code = str(exc.status())
                if code in REJECTED:
                    raise _Rejected(exc.message()) from None
                if self.job.version is not None and "is not routed here" in (exc.message() or ""):
                    raise BatchError(f"--version {self.job.version}: {exc.message()}; route that version "
                                     "(exporter route) or drop --version") from None
                if code == "StatusCode.INTERNAL" and internal < INTERNAL_ATTEMPTS - 1:
                    internal += 1
                elif code == "StatusCode.INTERNAL":
                    raise _Rejected(exc.message(), rule="internal") from None
                elif code not in RETRYABLE:
                    raise BatchError(f"{self.job.model}: {code} {exc.message()}") from None
                waited = time.monotonic() - started
                if waited > self.job.retry_timeout_s:
                    raise BatchError(f"{self.job.model}: no answer for {waited:.0f} s (--retry-timeout); "
                                     f"last: {code} {exc.message()}") from None
                self.sleep(_backoff(attempt, exc.message()))
                attempt += 1
                continue
            served = res.as_numpy(SERVED_BY).reshape(-1)
            if self.job.version is not None and any(version_of(s.decode()) != self.job.version for s in set(served)):
                # the guard pins; another answer is a response-cache hit (the primary's answers)
                raise BatchError(f"--version {self.job.version}: {self.job.model} answered from "
                                 f"{sorted(s.decode() for s in set(served))}; turn the guard's response cache "
                                 "off to score with a version other than the primary")
            return {**{o.name: res.as_numpy(o.name) for o in self.job.outputs}, SERVED_BY: served}


class _Rejected(Exception):
    def __init__(self, message: str, rule: str | None = None):
        super().__init__(message)
        self.message = message
        m = _RULE.search(message)
        self.rule = rule or (m.group(1) if m else "invalid_argument")


def _backoff(attempt: int, message: str) -> float:
    """Exponential backoff with full jitter (50 ms doubling, capped at 5 s), never shorter than
    the retry advice a quota gives (``retry after N ms``)."""
    pause = random.uniform(0, min(5.0, 0.05 * 2 ** attempt))
    m = _RETRY_AFTER.search(message or "")
    return max(pause, int(m.group(1)) / 1000) if m else pause


def version_of(served_by: str) -> int | None:
    """``digits_raw:2`` and ``cache:digits_raw:2`` -> 2; a default answer -> None."""
    tail = served_by.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None
