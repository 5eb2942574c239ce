"""A stream guard's target outside Triton: any server that speaks the OpenAI protocol, by URL
(``placement: openai``; vLLM's and TGI's OpenAI servers, ``transformers serve``, ...).

The guard stays in Triton and keeps every stage (validation, tenancy and token budgets,
redaction across tokens, output rails, caches, audit, routing with canary and shadow); only the
call to the target changes: instead of a BLS stream to a model in the same server, each
generation is one streamed ``POST {target_url}/completions`` (``stream: true``, server-sent
events). An :class:`OpenAIStream` looks to the guard like an in-process target's
:class:`~tritonguard.generation.local.LocalStream` (responses in lists, ``cancel()``), so the
forwarder, the rails and the budgets run unchanged on its pieces.

- The sampling keys the guard passes on (``max_tokens``, ``temperature``, ``top_p``, ``seed``)
  become the request's fields of the same names; ``model`` is ``target_model``.
- Stopping a generation (a client's cancel, a rail's block, ``max_tokens``) closes the HTTP
  stream: the OpenAI servers stop generating for a client that went away (vLLM aborts the
  request on disconnect), which is the protocol's only way to say stop.
- A server that cannot be reached, or answers 5xx/401/429, fails the generation with
  UNAVAILABLE (HTTP 503 at the front), as a BLS target that is not loaded does; 400/422 is the
  request's fault (INVALID_ARG); 404 (an unknown model) is NOT_FOUND. The guard's fallback and
  breakers treat them as they treat a Triton target's.
- The API key comes from an environment variable (``target_api_key_env``) or a file
  (``target_api_key_file``), is sent as ``Authorization: Bearer``, and is never in a log line or
  an error message (an upstream message that echoes it gets it masked).

Plain ``http.client`` on the reader thread (one connection per generation): a cancel from the
guard's worker thread shuts the socket down, which ends the blocked read at once.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonguard.core.errors import ConfigError
from tritonguard.generation.local import LocalStream
from tritonguard.rollout.endpoints import Endpoint, EndpointsView, check_url

__all__ = ["OpenAIClient", "OpenAIStream", "VersionTargets", "check_url", "openai_client"]

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "seed")  # the guard's keys, same names in OpenAI's request
MAX_ERROR_BODY = 4096  # bytes of an error answer read for its message
MAX_LINE = 1 << 20  # one SSE line; a longer one is a broken stream
MAX_TOKENS_PADDED = 1 << 20  # a usage figure above this is not believed


def read_key(env: str, file: str, *, model: str = "?") -> str | None:
    """The API key from the environment variable ``env`` or the file ``file`` (None: neither
    set). A missing variable or unreadable file is a ConfigError naming it, never its value."""
    if env:
        value = os.environ.get(env, "").strip()
        if not value:
            raise ConfigError(f"model '{model}': parameter 'target_api_key_env' names {env!r}, which is not set")
        return value
    if file:
        try:
            value = Path(file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"model '{model}': parameter 'target_api_key_file': cannot read it "
                              f"({type(exc).__name__})") from None
        if not value:
            raise ConfigError(f"model '{model}': parameter 'target_api_key_file' is empty")
        return value
    return None


def completion_request(model: str, prompt: str, sampling: str) -> dict[str, Any]:
    """The body of a streamed ``/completions`` call for one generation: the guard's sampling
    JSON (already validated and capped by the guard) mapped onto OpenAI's fields."""
    # usage in the last chunk: the server's own token count (vLLM sends it only when asked)
    body: dict[str, Any] = {"model": model, "prompt": prompt, "stream": True,
                            "stream_options": {"include_usage": True}}
    params = json.loads(sampling) if sampling else {}
    for key in SAMPLING_KEYS:
        if params.get(key) is not None:
            body[key] = params[key]
    return body


def status_code(status: int) -> str:
    """The Triton error code of an upstream HTTP status: the request's fault, an unknown model,
    or the target being unable to serve (503 at the guard's front)."""
    if status in (400, 413, 422):
        return "INVALID_ARG"
    if status == 404:
        return "NOT_FOUND"
    return "UNAVAILABLE"


@dataclass(frozen=True)
class _Key:
    value: str | None

    def __repr__(self) -> str:  # never printed, whatever prints the client
        return "_Key(***)" if self.value else "_Key(None)"


class OpenAIStream(LocalStream):
    """One generation's responses from an OpenAI-protocol server (read on a thread of its own)."""

    cheap_cancel_check = False

    def __init__(self) -> None:
        super().__init__()
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self.closed = False  # the HTTP stream is closed (ended, failed or cancelled)
        self.received = 0  # pieces read from the server (what a stop must keep small)

    def piece(self, text: str) -> None:
        self.received += 1
        super().piece(text)

    def _attach(self, conn: http.client.HTTPConnection) -> bool:
        with self._lock:
            if self._cancel:
                return False
            self._conn = conn
            return True

    def cancel(self) -> None:
        """Stop the generation: close the HTTP stream (the reader's blocked read ends at once;
        the server sees its client go away and stops generating)."""
        with self._lock:
            self._cancel = True
            conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    close = cancel  # a finished generation's connection, released (TargetCalls.retire)


class OpenAIClient:
    """Generations of one OpenAI-compatible server for a stream guard (``open`` as
    :class:`~tritonguard.generation.local.LocalGenerator`'s: every version is served by the URL;
    the version is the guard's label for routing, breakers and comparisons)."""

    def __init__(self, url: str, model: str, *, key: str | None = None, guard: str = "", target: str = "",
                 timeout_s: float = 30.0) -> None:
        self.url = check_url(url)
        parts = urllib.parse.urlsplit(self.url)
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname or "", parts.port or (443 if self.https else 80)
        self.path = (parts.path or "") + "/completions"
        self.model, self.guard, self.target = model, guard, target
        self._key = _Key(key)
        # a read that waits longer than the guard's idle limit ends the reader thread: the guard
        # has given up on the stream by then (TargetStalled)
        self.timeout_s = timeout_s + 1.0
        self.where = f"{parts.scheme}://{parts.netloc}{parts.path}"  # for messages: never the key
        log.info("stream guard %s: target '%s' is served by the OpenAI-compatible server %s (model %r, API key %s)",
                 guard, target, self.where, model, "set" if key else "none")

    def _mask(self, text: str) -> str:
        key = self._key.value
        return text.replace(key, "***") if key else text

    def _headers(self, body: bytes) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream",
                   "Content-Length": str(len(body))}
        if self._key.value:
            headers["Authorization"] = f"Bearer {self._key.value}"
        return headers

    def open(self, version: int, prompt: str, stream: bool, sampling: str, exclude: bool | None) -> OpenAIStream:
        """Start one generation; its pieces come through the returned stream (an error response
        when the server cannot be reached or refuses it). A whole-text answer (``stream`` false)
        is streamed from the server too, so it can be stopped, and gets the prompt in front
        unless ``exclude`` (the vLLM backend's contract)."""
        out = OpenAIStream()
        try:
            body = json.dumps(completion_request(self.model, prompt, sampling)).encode()
        except (ValueError, TypeError) as exc:
            out.fail(f"bad sampling parameters for the OpenAI target: {exc}", "INVALID_ARG")
            return out
        prepend = (not stream) if exclude is None else not exclude
        threading.Thread(target=self._run, args=(out, body, prompt if prepend else ""), daemon=True,
                         name=f"openai-{self.guard}").start()
        return out

    def _run(self, out: OpenAIStream, body: bytes, prefix: str) -> None:
        """The reader thread: the call, its pieces, then its end (the connection closed first,
        so whoever reads the end knows the upstream stream is closed)."""
        conn_cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = conn_cls(self.host, self.port, timeout=self.timeout_s)
        failure: tuple[str, str] | None = None
        try:
            failure = self._call(out, conn, body, prefix)
        except Exception as exc:  # noqa: BLE001 - the guard gets an error response, never a dead stream
            if not out.cancelled():
                failure = (f"the OpenAI-compatible server {self.where} broke off the stream "
                           f"({type(exc).__name__}: {self._mask(str(exc))})", "UNAVAILABLE")
        finally:
            conn.close()
            out.closed = True
            if failure is not None:
                out.fail(*failure)
            else:
                out.finish(None)

    def _call(self, out: OpenAIStream, conn: http.client.HTTPConnection, body: bytes,
              prefix: str) -> tuple[str, str] | None:
        """One streamed call; (message, code) when it failed, None when it ended or was cancelled."""
        if not out._attach(conn):
            return None  # cancelled before it began
        try:
            conn.request("POST", self.path, body=body, headers=self._headers(body))
            resp = conn.getresponse()
        except OSError as exc:
            if out.cancelled():
                return None
            return (f"the OpenAI-compatible server {self.where} cannot be reached "
                    f"({type(exc).__name__}: {self._mask(str(exc))})", "UNAVAILABLE")
        if resp.status != 200:
            return self._refusal(resp), status_code(resp.status)
        return self._read(out, resp, prefix)

    def _refusal(self, resp: http.client.HTTPResponse) -> str:
        """The message of an upstream error answer: its status and OpenAI error message."""
        try:
            raw = resp.read(MAX_ERROR_BODY).decode("utf-8", "replace")
        except OSError:
            raw = ""
        detail = raw.strip()
        try:
            doc = json.loads(raw)
            err = doc.get("error") if isinstance(doc, dict) else None
            detail = str(err.get("message") if isinstance(err, dict) else err or doc.get("detail") or doc)
        except (ValueError, AttributeError):
            pass
        detail = " ".join(self._mask(detail).split())[:300]
        return f"the OpenAI-compatible server {self.where} answered {resp.status}" + (f": {detail}" if detail else "")

    def _read(self, out: OpenAIStream, resp: http.client.HTTPResponse, prefix: str) -> tuple[str, str] | None:
        """Server-sent events -> pieces: each ``data:`` line's ``choices[0].text`` (an empty one
        is skipped), until ``[DONE]`` or the end of the stream; (message, code) for an error event.

        The guard counts a target's tokens by its responses (budgets, ``max_tokens``); a server
        holds back a token that ends inside a UTF-8 character and sends it with the next, so when
        the last chunk's ``usage`` says more tokens were generated than pieces came, empty
        pieces make up the difference."""
        if prefix:
            out.piece(prefix)
        pieces = 0
        while True:
            line = resp.readline(MAX_LINE)
            if not line or out.cancelled():
                return None  # the server closed the stream, or the guard cancelled it
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event:/id: fields
            data = line[5:].strip()
            if data == b"[DONE]":
                return None
            event = json.loads(data)
            if isinstance(event, dict) and event.get("error"):
                err = event["error"]
                message = err.get("message") if isinstance(err, dict) else err
                return (f"the OpenAI-compatible server {self.where} failed mid-stream: "
                        f"{self._mask(str(message))[:300]}", "UNAVAILABLE")
            for choice in event.get("choices") or ():
                text = choice.get("text")
                if text:
                    out.piece(text)
                    pieces += 1
            usage = event.get("usage") if isinstance(event, dict) else None
            generated = usage.get("completion_tokens") if isinstance(usage, dict) else None
            if isinstance(generated, int):
                for _ in range(min(generated, MAX_TOKENS_PADDED) - pieces):
                    out.piece("")
                pieces = max(pieces, generated)

    def close(self) -> None:
        """Nothing pooled: each generation's connection closes with it."""


def openai_client(url: str, model: str, key_env: str, key_file: str, *, guard: str, target: str,
                  timeout_s: float) -> OpenAIClient:
    """The client a guard with ``placement: openai`` reads its target through."""
    return OpenAIClient(url, model or target, key=read_key(key_env, key_file, model=guard), guard=guard,
                        target=target, timeout_s=timeout_s)


class _Unusable:
    """A declared version whose client cannot be made (its API key is not there): every
    generation fails with UNAVAILABLE naming why, so the guard falls back and its breaker counts it."""

    def __init__(self, message: str) -> None:
        self.message = message

    def open(self, version: int, prompt: str, stream: bool, sampling: str, exclude: bool | None) -> OpenAIStream:
        out = OpenAIStream()
        out.closed = True
        out.fail(self.message, "UNAVAILABLE")
        return out

    def close(self) -> None:
        pass


class VersionTargets:
    """The versions of a guard's target that are served at a URL
    (:mod:`tritonguard.rollout.endpoints`: ``endpoints.json`` beside the target's config.pbtxt):
    ``self(version)`` is that version's client, or None for a version served as the guard's
    placement says (BLS, in process, or its one ``target_url``). A client is made when a
    version is first called and again when its declaration changes."""

    def __init__(self, model_dir: str | os.PathLike, *, guard: str, target: str, timeout_s: float,
                 view: EndpointsView | None = None) -> None:
        self.view = view if view is not None else EndpointsView(model_dir)
        self.guard, self.target, self.timeout_s = guard, target, timeout_s
        self._clients: dict[int, tuple[Endpoint, Any]] = {}
        self._lock = threading.Lock()

    def __call__(self, version: int) -> Any:
        endpoint = self.view.get(version)
        if endpoint is None:
            return None
        with self._lock:
            known = self._clients.get(version)
            if known is not None and known[0] == endpoint:
                return known[1]
            try:
                client: Any = openai_client(endpoint.url, endpoint.model or self.target, endpoint.api_key_env,
                                            endpoint.api_key_file, guard=self.guard,
                                            target=f"{self.target} v{version}", timeout_s=self.timeout_s)
            except ConfigError as exc:
                log.warning("stream guard %s: v%d of '%s' is declared at %s but cannot be called: %s", self.guard,
                            version, self.target, endpoint.url, exc)
                client = _Unusable(f"v{version} of '{self.target}' (at {endpoint.url}) cannot be called: {exc}")
            self._clients[version] = (endpoint, client)
            return client

    def close(self) -> None:
        with self._lock:
            for _, client in self._clients.values():
                client.close()
            self._clients.clear()
