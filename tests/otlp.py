"""A minimal OTLP/HTTP trace receiver for tests: JSON bodies (what Triton 2.51 and the guard's
exporter send) on a loopback port, decoded into flat span records.

Real enough to catch what a collector would see: it parses the OTLP JSON encoding
(``resourceSpans`` → ``scopeSpans`` → ``spans``, hex ids, typed attribute values), answers 200
like the collector's ``otlp`` receiver, and keeps every span with its resource's service name.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _value(v: dict[str, Any]) -> Any:
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return v


def _attrs(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {a["key"]: _value(a.get("value", {})) for a in items or []}


def decode(body: dict[str, Any]) -> list[dict[str, Any]]:
    """OTLP JSON ``ExportTraceServiceRequest`` -> one dict per span."""
    spans = []
    for rs in body.get("resourceSpans", []):
        resource = _attrs(rs.get("resource", {}).get("attributes"))
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                spans.append({
                    "service": resource.get("service.name"),
                    "resource": resource,
                    "trace_id": s.get("traceId", "").lower(),
                    "span_id": s.get("spanId", "").lower(),
                    "parent_id": (s.get("parentSpanId") or "").lower(),
                    "name": s.get("name"),
                    "start": int(s.get("startTimeUnixNano", 0)),
                    "end": int(s.get("endTimeUnixNano", 0)),
                    "attributes": _attrs(s.get("attributes")),
                    "status": s.get("status", {}),
                    "events": [e.get("name") for e in s.get("events", [])],
                })
    return spans


class Receiver:
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.bodies = 0
        self.rejected: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    raw = gzip.decompress(raw)
                ctype = self.headers.get("content-type", "")
                try:
                    if self.path != "/v1/traces" or "json" not in ctype:
                        raise ValueError(f"{self.path} {ctype}")
                    got = decode(json.loads(raw))
                except ValueError as exc:
                    with receiver._lock:
                        receiver.rejected.append(str(exc))
                    self.send_response(400)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                with receiver._lock:
                    receiver.spans.extend(got)
                    receiver.bodies += 1
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = 20.0
                 ) -> list[dict[str, Any]]:
        """Spans once ``predicate(spans)`` holds; the last snapshot after ``timeout``."""
        deadline = time.monotonic() + timeout
        spans = self.snapshot()
        while time.monotonic() < deadline:
            if predicate(spans):
                return spans
            time.sleep(0.2)
            spans = self.snapshot()
        return spans

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
