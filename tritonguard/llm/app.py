"""The ASGI app of the OpenAI-compatible front (Starlette): ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /health``.

Each completion is one generation of the guard (:mod:`tritonguard.llm.upstream`). Streamed
(``stream: true``) it is a server-sent event per piece the guard sends, then a last chunk with
``finish_reason`` and ``usage`` (with ``stream_options.include_usage`` also OpenAI's extra chunk
with empty ``choices`` and the usage), then ``data: [DONE]``. The first piece is awaited before
the response starts, so a refusal (bad field, authentication, quota, no version) is a plain JSON
error with its status; an error after the first piece is an ``{"error": ...}`` event. A client
that disconnects stops the generation: the front sends the guard a stop request and reads the
guard's stream to its end in the background, never cancelling it
(:mod:`tritonguard.llm.upstream`).

``finish_reason``: ``stop`` (the model ended, or a ``stop`` sequence: the guard cuts the answer
before it and stops the target, so the front reads the stream to its end and never cancels it),
``length`` (the answer reached ``max_tokens``, the guard's ``validation.default_max_tokens`` when
none was sent, or the tenant's token budget cut it), ``content_filter`` (the guard blocked the
answer). A guard that declares the output ``finish_reason`` says which on its final response, and
the front passes that on (only the guard knows of a budget's cut); for one without it the front
counts the answer against ``max_tokens``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tritonguard.llm.errors import OpenAIError, bad_request
from tritonguard.llm.protocol import Ask, chunk, new_id, parse, response, usage
from tritonguard.llm.template import ChatTemplate
from tritonguard.llm.upstream import ContentFiltered, Ending, GuardInfo, Upstream
from tritonguard.privacy.tenancy.auth import ApiKeys

log = logging.getLogger(__name__)
ANONYMOUS = "authentication required: send header 'Authorization: Bearer <API key>'"


@dataclass
class FrontConfig:
    """What one front serves: the guards (``models``) on one Triton (``server``, gRPC)."""

    server: str
    models: list[str]
    template: ChatTemplate = field(default_factory=ChatTemplate)
    # a guard without tenancy.auth: the front checks keys itself (tenancy.keys_file's format)
    # and names the tenant; None: the key is not checked (every request is the default tenant)
    keys: ApiKeys | None = None
    idle_timeout_s: float = 60.0


def _error(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _bearer(request: Request) -> str | None:
    raw = request.headers.get("authorization")
    if raw is None:
        return None
    scheme, _, key = raw.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise OpenAIError(401, "authentication failed: header 'Authorization' must be 'Bearer <API key>'",
                          "invalid_request_error", None, "invalid_api_key")
    return key.strip()


class Front:
    """The handlers; :func:`build_app` wires them to routes and to the app's lifespan."""

    def __init__(self, config: FrontConfig) -> None:
        self.config = config
        self.upstream: Upstream | None = None
        self.created = int(time.time())

    def _up(self) -> Upstream:
        if self.upstream is None:  # the lifespan creates it in the server's event loop
            self.upstream = Upstream(self.config.server, idle_timeout_s=self.config.idle_timeout_s)
        return self.upstream

    def parameters(self, request: Request, info: GuardInfo) -> dict[str, str]:
        """The credential's (or tenant's) request parameters for the guard; 401 when it is missing
        where one is required, or (front-checked keys) unknown. A key is never in a message."""
        key = _bearer(request)
        if info.auth != "none":
            if key is None and info.refuse_anonymous:
                raise OpenAIError(401, ANONYMOUS, "invalid_request_error", None, "invalid_api_key")
            return info.parameters(key, None)  # the guard verifies it
        keys = self.config.keys
        if keys is None:
            return {}
        if key is None:
            raise OpenAIError(401, ANONYMOUS, "invalid_request_error", None, "invalid_api_key")
        keys.refresh()
        tenant, _why = keys.verify(key)
        if tenant is None:
            raise OpenAIError(401, "authentication failed: unknown API key", "invalid_request_error", None,
                              "invalid_api_key")
        return info.parameters(None, tenant)

    # -- routes ---------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model(m) for m in self.config.models]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.config.models:
            return _error(OpenAIError(404, f"the model '{name}' does not exist", "invalid_request_error", "model",
                                      "model_not_found"))
        return JSONResponse(self._model(name))

    def _model(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "tritonguard"}

    async def health(self, request: Request) -> Response:
        live = await self._up().live()
        return JSONResponse({"status": "ok" if live else "unavailable"}, status_code=200 if live else 503)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            try:
                body = await request.json()
            except ValueError:
                raise bad_request("the request body is not valid JSON", None, "invalid_json") from None
            ask = parse(body, chat=chat)
            if ask.model not in self.config.models:
                raise OpenAIError(404, f"the model '{ask.model}' does not exist", "invalid_request_error", "model",
                                  "model_not_found")
            up = self._up()
            info = await up.info(ask.model)
            params = self.parameters(request, info)
            if chat:
                ask.prompt = self.config.template.render(ask.messages)
            ending = Ending() if info.reasons else None
            pieces = up.generate(ask.model, ask.prompt, ask.stream, ask.sampling, params, chat=chat, ending=ending)
            limit = ask.max_tokens or info.default_max_tokens
            if not ask.stream:
                return await self._whole(ask, pieces, limit, ending)
            return await self._stream(ask, pieces, limit, ending)
        except OpenAIError as exc:
            if exc.status >= 500:
                log.warning("openai front: %d %s", exc.status, exc.message)
            return _error(exc)

    def _finish(self, raw: str, limit: int, ending: Ending | None) -> str:
        if ending is not None and ending.reason is not None:  # the guard's own reason
            return ending.reason
        return "length" if self.config.template.count(raw) >= limit else "stop"

    def _usage(self, ask: Ask, text: str) -> dict[str, int]:
        count = self.config.template.count
        return usage(count(ask.prompt), count(text))

    async def _whole(self, ask: Ask, pieces: AsyncIterator[str], limit: int, ending: Ending | None) -> Response:
        out, finish = [], None
        try:
            async for piece in pieces:
                out.append(piece)
        except ContentFiltered:
            finish = "content_filter"
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]
        text = "".join(out)
        finish = finish or self._finish(text, limit, ending)
        body = response(ask, new_id(ask.chat), (ask.prompt + text) if ask.echo else text, finish,
                        self._usage(ask, text))
        return JSONResponse(body)

    async def _stream(self, ask: Ask, pieces: AsyncIterator[str], limit: int, ending: Ending | None) -> Response:
        filtered = False
        try:  # the first piece before the response starts: a refusal keeps its status
            first: str | None = await pieces.__anext__()
        except StopAsyncIteration:
            first = None
        except ContentFiltered:
            first, filtered = None, True
        except OpenAIError:
            await pieces.aclose()  # type: ignore[attr-defined]
            raise
        rid, created = new_id(ask.chat), int(time.time())

        async def events() -> AsyncIterator[str]:
            sent: list[str] = []
            finish = "content_filter" if filtered else None
            try:
                if ask.chat:
                    yield _sse(chunk(ask, rid, created, "", first=True))
                elif ask.echo:
                    yield _sse(chunk(ask, rid, created, ask.prompt))

                async def rest() -> AsyncIterator[str]:
                    if first is not None:
                        yield first
                    if first is not None or not filtered:
                        async for p in pieces:
                            yield p

                try:
                    async for piece in rest():
                        if piece:
                            sent.append(piece)
                            yield _sse(chunk(ask, rid, created, piece))
                except ContentFiltered:
                    finish = "content_filter"
                except OpenAIError as exc:  # after the first piece: an error event ends the stream
                    log.warning("openai front: stream failed: %s", exc.message)
                    yield _sse(exc.body())
                    yield "data: [DONE]\n\n"
                    return
                finish = finish or self._finish("".join(sent), limit, ending)
                use = self._usage(ask, "".join(sent))
                yield _sse(chunk(ask, rid, created, None if ask.chat else "", finish, use=use))
                if ask.include_usage:
                    yield _sse(chunk(ask, rid, created, None, use=use, no_choices=True))
                yield "data: [DONE]\n\n"
            finally:
                with contextlib.suppress(Exception):
                    await pieces.aclose()  # type: ignore[attr-defined]

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def build_app(config: FrontConfig) -> Starlette:
    """The app; its lifespan opens the gRPC channel in the server's loop and closes it at exit."""
    front = Front(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        up = front._up()
        for model in config.models:  # the guards' settings now; one not reachable yet is read later
            try:
                info = await up.info(model)
            except OpenAIError as exc:
                log.warning("openai front: %s (read again on its first request)", exc.message)
                continue
            if info.unsure_length:
                log.warning("openai front: %s", info.unsure_length)
        yield
        await up.close()

    app = Starlette(routes=[
        Route("/v1/models", front.models, methods=["GET"]),
        Route("/v1/models/{model:path}", front.model, methods=["GET"]),
        Route("/v1/completions", front.completions, methods=["POST"]),
        Route("/v1/chat/completions", front.chat, methods=["POST"]),
        Route("/health", front.health, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.front = front
    return app
