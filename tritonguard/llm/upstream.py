"""The stream guard over Triton gRPC streaming: one bidirectional stream per generation.

The guard's inputs are the vLLM backend's contract (``text_input``, ``stream``,
``sampling_parameters``, ``exclude_input_in_output`` -> ``text_output``); the tenant and its
credential travel as request parameters, exactly as the guard reads them from any Triton client
(:mod:`tritonguard.privacy.tenancy.auth`): with ``tenancy.auth=api_key`` the bearer key goes in
the parameter named by the guard's ``tenancy.key_header``, with ``jwt`` ``"Bearer <token>"`` in
``tenancy.jwt_header``; with ``none`` the front may resolve the key itself (``--keys-file``, the
same file format) and name the tenant in ``tenancy.parameter``. The guard's settings are read
once from its ``config.pbtxt`` over gRPC (``ModelConfig``).

Each generation opens its own stream on one shared channel, sends its one request (with an id
of its own) and reads until Triton's final response (``triton_enable_empty_final_response``).
Leaving early (a client that went away, a timeout) does not cancel the stream: the front sends
the guard a stop request naming that id (:mod:`tritonguard.guard.stream.stops`), the guard stops
the target and ends the stream with a plain final response, and the front reads it to its end in
the background. A cancelled stream is what Triton 2.51 can keep counted live until its exit
timeout (docs/stream-guard.md); only a guard that does not end a stopped stream within the idle
timeout gets it cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tritonguard.generation.contract import STOP_PREFIX
from tritonguard.guard.stream.config import parse_settings
from tritonguard.llm.errors import OpenAIError, from_guard

log = logging.getLogger(__name__)
OUTPUT = "text_output"
# the guard's optional output (the vLLM backend's name): its final response says why the answer
# ended, ``stop``, ``length`` (max_tokens, or the tenant's token budget cut it) or content_filter
REASON = "finish_reason"
REASONS = ("stop", "length", "content_filter")
# a guard that blocks an answer ends its stream with an error naming this reason (issue 42,
# item 2): the client gets finish_reason "content_filter", not an error
CONTENT_FILTER = "content_filter"


@dataclass(frozen=True)
class GuardInfo:
    """What the front needs of a guard's settings (its ``config.pbtxt`` parameters)."""

    name: str
    auth: str = "none"  # tenancy.auth: none | api_key | jwt
    credential: str = ""  # the parameter the guard reads the credential from
    tenant_parameter: str = "tenant"
    refuse_anonymous: bool = True  # tenancy.unauthenticated == refuse
    default_max_tokens: int = 16
    max_tokens: int = 256
    reasons: bool = False  # the config declares the output ``finish_reason``
    budget: bool = False  # tokens.per_minute is set: the guard may cut an answer short

    @property
    def unsure_length(self) -> str | None:
        """Why this front cannot tell a budget's cut from the model's end (None: it can)."""
        if self.budget and not self.reasons:
            return (f"guard '{self.name}' has a token budget (tokens.per_minute) but no output 'finish_reason': "
                    "an answer the budget cuts reads finish_reason 'stop' here; declare the output "
                    "(TYPE_STRING, dims [1]) in its config.pbtxt")
        return None

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> GuardInfo:
        params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        try:
            s = parse_settings(params, model=name)
        except Exception as exc:  # noqa: BLE001 - not a stream guard's parameters
            raise ValueError(f"model '{name}' is not a stream guard this front can serve: {exc}") from None
        t = s.tenancy
        credential = {"api_key": t.key_header, "jwt": t.jwt_header}.get(t.auth, "") if t.enabled else ""
        return cls(name=name, auth=t.auth if t.enabled else "none", credential=credential,
                   tenant_parameter=t.parameter, refuse_anonymous=t.unauthenticated == "refuse",
                   default_max_tokens=s.validation.default_max_tokens, max_tokens=s.validation.max_tokens,
                   reasons=REASON in {o.get("name") for o in config.get("output") or []},
                   budget=s.tokens.per_minute > 0)

    def parameters(self, key: str | None, tenant: str | None) -> dict[str, str]:
        """The request parameters that carry the client's credential (or the tenant the front
        resolved) the way this guard reads them."""
        if self.auth == "api_key" and key:
            return {self.credential: key}
        if self.auth == "jwt" and key:
            return {self.credential: f"Bearer {key}"}
        if self.auth == "none" and tenant:
            return {self.tenant_parameter: tenant}
        return {}


def _inputs(prompt: str, stream: bool, sampling: dict[str, Any]) -> list[Any]:
    import tritonclient.grpc as grpcclient  # noqa: PLC0415 - gRPC loads with the front only

    out = []
    for name, arr, dtype in (
            ("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"),
            ("stream", np.array([stream], dtype=bool), "BOOL"),
            ("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
            ("exclude_input_in_output", np.array([True], dtype=bool), "BOOL")):
        if name == "exclude_input_in_output" and stream:
            continue  # a streamed answer never repeats the prompt (the contract refuses the flag with stream)
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


class Upstream:
    """The guard's Triton over gRPC (``tritonclient.grpc.aio``); create inside the event loop."""

    def __init__(self, url: str, *, idle_timeout_s: float = 60.0) -> None:
        from tritonclient.grpc.aio import InferenceServerClient  # noqa: PLC0415

        self.url = url
        self.client = InferenceServerClient(url)
        self.idle_timeout_s = idle_timeout_s
        self._info: dict[str, GuardInfo] = {}
        self._background: set[asyncio.Task] = set()  # the streams' readers, and stops (_stop)

    async def close(self, wait_s: float = 5.0) -> None:
        """Close the channel once the streams being stopped have ended (at most ``wait_s``)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=wait_s)
        await self.client.close()

    async def info(self, model: str) -> GuardInfo:
        """The guard's settings, read once (a failure is retried on the next request)."""
        hit = self._info.get(model)
        if hit is not None:
            return hit
        from tritonclient.utils import InferenceServerException  # noqa: PLC0415

        try:
            cfg = await self.client.get_model_config(model, as_json=True)
        except InferenceServerException as exc:
            raise _grpc_error(exc) from None
        try:
            info = GuardInfo.from_config(model, cfg.get("config", cfg))
        except ValueError as exc:
            raise OpenAIError(503, str(exc), "server_error", "model", "model_not_servable") from None
        self._info[model] = info
        return info

    async def live(self) -> bool:
        try:
            return bool(await self.client.is_server_live())
        except Exception:  # noqa: BLE001 - anything but a yes is a no
            return False

    async def generate(self, model: str, prompt: str, stream: bool, sampling: dict[str, Any],
                       parameters: dict[str, str], *, chat: bool = False,
                       ending: Ending | None = None) -> AsyncIterator[str]:
        """The guard's answer in pieces (one piece when not ``stream``). A refusal or failure
        raises :class:`OpenAIError`; a blocked answer ends with :class:`ContentFiltered`. A
        guard that declares ``finish_reason`` names its reason on the final response: it goes
        into ``ending`` (a token budget's cut is only known there).

        The stream is read by a task of its own (:meth:`_pump`), never by the caller's: a caller
        cancelled (its HTTP client went away, and Starlette cancels the response's task) would
        otherwise cancel the gRPC read, and grpc cancels the call with it. Left early, the
        generation is stopped by a stop request instead (:meth:`_stop`)."""
        rid = f"oai-{uuid.uuid4().hex}"
        done = asyncio.Event()
        request = {"model_name": model, "inputs": _inputs(prompt, stream, sampling), "request_id": rid,
                   "parameters": {**parameters, "triton_enable_empty_final_response": True}}

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield request
            await done.wait()  # the stream stays open until the final response is read

        call = self.client.stream_infer(requests())
        inbox: asyncio.Queue = asyncio.Queue()
        pump = self._keep(self._pump(call, inbox, done))
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(inbox.get(), self.idle_timeout_s)
                except asyncio.TimeoutError:
                    raise OpenAIError(504, f"model '{model}' sent nothing for {self.idle_timeout_s:g} s",
                                      "server_error", None, "timeout") from None
                if item is _ENDED:
                    finished = True
                    raise OpenAIError(502, f"model '{model}': the stream ended without a final response",
                                      "server_error")
                if isinstance(item, BaseException):
                    finished = True
                    raise _stream_error(item)
                result, error = item
                if error is not None:
                    finished = True
                    message = error.message() if hasattr(error, "message") else str(error)
                    if CONTENT_FILTER in message:
                        raise ContentFiltered(message)
                    raise from_guard(message or str(error), chat=chat)
                if ending is not None:  # before the text is yielded: a consumer may stop at it
                    ending.read(result)
                out = result.as_numpy(OUTPUT)
                if out is not None and out.size:
                    text = b"".join(x if isinstance(x, bytes) else str(x).encode() for x in out.reshape(-1))
                    if text:
                        yield text.decode("utf-8", errors="replace")
                if _final(result):
                    finished = True
                    return
        finally:
            if not finished:  # a client gone, a timeout: the guard is asked to stop, the rest drained
                self._keep(self._stop(model, rid, parameters, call, pump, done))

    async def _pump(self, call: Any, inbox: asyncio.Queue, done: asyncio.Event) -> None:
        """Read ``call`` into ``inbox`` up to its final response (an error response is final too),
        then close the request side and read on to the call's end: a call dropped before the
        server ended it is cancelled when grpc frees it, and a cancel is what this avoids."""
        try:
            async for item in call:
                inbox.put_nowait(item)
                result, error = item
                if error is not None or _final(result):
                    break
            else:
                inbox.put_nowait(_ENDED)
                return
            done.set()
            await asyncio.wait_for(_read_to_end(call), self.idle_timeout_s)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            log.warning("openai front: the server did not end a finished stream within %g s", self.idle_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the reader raises it where it reads
            inbox.put_nowait(exc)
        finally:
            done.set()

    async def _stop(self, model: str, rid: str, parameters: dict[str, str], call: Any, pump: asyncio.Task,
                    done: asyncio.Event) -> None:
        """Stop generation ``rid``: a stop request (``STOP_PREFIX`` + its id, the same credential;
        the guard ends that stream with a plain final response), then its stream read to the end
        in the background (:meth:`_pump`). Only a guard that does not end it within
        ``idle_timeout_s`` gets the stream cancelled."""
        stopped = asyncio.Event()

        async def ask() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": model, "inputs": _inputs("", True, {}), "request_id": STOP_PREFIX + rid,
                   "parameters": {**parameters, "triton_enable_empty_final_response": True}}
            await stopped.wait()

        async def stop_call() -> None:
            responses = self.client.stream_infer(ask())
            try:
                async for _result, error in responses:  # one final response, then the call's end
                    if error is not None:
                        log.warning("openai front: the stop request for %s was refused: %s", model, error)
                    stopped.set()
            finally:
                stopped.set()

        try:
            await asyncio.wait_for(stop_call(), self.idle_timeout_s)
            await asyncio.wait_for(asyncio.shield(pump), self.idle_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a timeout or a failed stop request: the last resort
            log.warning("openai front: generation %s of %s did not end after a stop request (%s); its stream "
                        "is cancelled", rid, model, type(exc).__name__)
            done.set()
            call.cancel()
            pump.cancel()

    def _keep(self, coro: Any) -> asyncio.Task:
        """Run ``coro`` beside the requests, held until it ends; :meth:`close` waits for it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task


class Ending:
    """Why the guard ended an answer, as its final response said (``reason`` None: a guard
    without the ``finish_reason`` output, or a stream that did not end)."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def read(self, result: Any) -> None:
        try:
            out = result.as_numpy(REASON)
        except Exception:  # noqa: BLE001 - not in this response
            return
        if out is None or not out.size:
            return
        raw = out.reshape(-1)[0]
        reason = (raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)).strip()
        if reason in REASONS:
            self.reason = reason


def _stream_error(exc: BaseException) -> OpenAIError:
    """What the stream's reader raised (tritonclient's exception, or grpc's own for a call that
    failed as a whole) as an OpenAI error; its detail stays in the front's log."""
    from tritonclient.utils import InferenceServerException  # noqa: PLC0415

    if isinstance(exc, InferenceServerException):
        return _grpc_error(exc)
    code = getattr(exc, "code", None)
    name = getattr(code(), "name", "") if callable(code) else ""
    log.warning("openai front: the guard's stream failed: %s: %s", type(exc).__name__, exc)
    if name == "UNAVAILABLE":
        return _unreachable()
    return OpenAIError(502, f"the guard's stream failed ({name or type(exc).__name__})", "server_error")


async def _read_to_end(call: Any) -> None:
    async for _item in call:
        pass


def _final(result: Any) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


_ENDED = object()  # the stream ended with no final response


class ContentFiltered(Exception):
    """The guard blocked the answer (an output rail): finish_reason ``content_filter``."""


def _grpc_error(exc: Any) -> OpenAIError:
    """A gRPC-level failure (the server down, the model unknown or not ready) as an OpenAI error."""
    status = str(exc.status() or "")
    message = exc.message() or str(exc)
    if "UNAVAILABLE" in status and "model" not in message.lower():
        return _unreachable()
    return from_guard(message)


def _unreachable() -> OpenAIError:
    return OpenAIError(503, "the inference server cannot be reached", "server_error", None, "service_unavailable", 1.0)
