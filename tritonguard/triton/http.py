"""One small HTTP client for Triton's own endpoints: health, repository index and model load
(KServe v2 and its extensions), and the Prometheus metrics port.

Every caller in the project (the test launcher, ``exporter`` serving/status/gates/tune) goes
through :func:`request`, so timeouts, the admin header and the way a connection failure is
worded are decided once. Not ``tritonclient.http``: it has no metrics endpoint, and it is built on
gevent's client, whose pool and greenlets a short CLI call or a health probe from a test has no
use for; these are a handful of plain requests, made from the standard library.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Mapping


class Unreachable(OSError):
    """The server did not answer at all: ``reason`` says why in a few words."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"{url}: {reason}")
        self.url, self.reason = url, reason


def reason(exc: BaseException, timeout: float) -> str:
    """A connection failure in a few words ("connection refused"), not urllib's repr."""
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        if not isinstance(exc.reason, BaseException):
            return str(exc.reason)
        exc = exc.reason
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror or exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def request(url: str, method: str = "GET", body: bytes | None = None, *,
            headers: Mapping[str, str] | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """``(status, body)`` of one request. An HTTP error status (4xx/5xx) is returned, not
    raised: Triton's error bodies say what went wrong. No answer at all (refused, timed out, a
    malformed URL) raises :class:`Unreachable`."""
    all_headers = {"Content-Type": "application/json"} if body is not None else {}
    all_headers.update(headers or {})
    try:
        req = urllib.request.Request(url, data=body, method=method, headers=all_headers)
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - operator-given URL
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError) as exc:  # URLError, timeouts; ValueError: a malformed URL
        raise Unreachable(url, reason(exc, timeout)) from None


def get_text(url: str, timeout: float = 5.0) -> str:
    """The body of a GET that must answer 200 (e.g. a metrics page); anything else raises
    :class:`Unreachable` naming the status."""
    status, body = request(url, timeout=timeout)
    if status != 200:
        raise Unreachable(url, f"HTTP {status}")
    return body.decode("utf-8", "replace")


__all__ = ["Unreachable", "get_text", "reason", "request"]
