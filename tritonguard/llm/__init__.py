"""The OpenAI-compatible front: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``
(streamed as server-sent events or not) served by a small ASGI app in front of a decoupled stream
guard on Triton gRPC (docs/llm.md).

- :mod:`~tritonguard.llm.protocol`: an OpenAI request body checked and turned into one generation
  for the guard (the vLLM backend's contract); the response bodies and chunks.
- :mod:`~tritonguard.llm.errors`: OpenAI error objects, and the guard's refusals mapped onto them
  (400 naming the field, 401, 429 with ``Retry-After``, 503).
- :mod:`~tritonguard.llm.template`: chat messages -> the prompt (the model's own template or a plain one).
- :mod:`~tritonguard.llm.upstream`: the guard over Triton gRPC streaming (one stream per request).
- :mod:`~tritonguard.llm.app`: the Starlette app; ``python -m tritonguard.llm`` serves it with uvicorn.
"""
