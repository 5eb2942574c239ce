"""``python -m exporter openai --server HOST:PORT --model GUARD [--port 8000]``: the
OpenAI-compatible front (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``) in front
of a decoupled stream guard on Triton gRPC (docs/llm.md).

The front is the serving stack's (:mod:`tritonguard.llm`), which the exporter never imports
(tests/unit/test_architecture.py): this command replaces its own process with
``python -m tritonguard.llm`` and the same options, so signals, logs and the exit code are the
front's own (0 after Ctrl-C or SIGTERM, 2 on bad arguments)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer


def front_argv(server: str, models: list[str], host: str, port: int, tokenizer: Path | None,
               keys_file: Path | None, idle_timeout_s: float, log_level: str) -> list[str]:
    """The front's command line for these options."""
    argv = [sys.executable, "-m", "tritonguard.llm", "--server", server, "--host", host, "--port", str(port),
            "--idle-timeout-s", str(idle_timeout_s), "--log-level", log_level]
    for model in models:
        argv += ["--model", model]
    if tokenizer is not None:
        argv += ["--tokenizer", str(tokenizer)]
    if keys_file is not None:
        argv += ["--keys-file", str(keys_file)]
    return argv


def openai_command(
    server: Annotated[str, typer.Option(help="Triton gRPC address of the guard, HOST:PORT.")],
    model: Annotated[list[str], typer.Option(help="A decoupled stream guard to serve (repeat for more).")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    tokenizer: Annotated[Path | None, typer.Option(help="A Hugging Face tokenizer folder: the model's chat "
                                                   "template and token counts (default: a plain template, "
                                                   "a token per character).")] = None,
    keys_file: Annotated[Path | None, typer.Option(help="For a guard without tenancy.auth: tenant -> SHA-256 "
                                                   "digests of its API keys; the front checks bearer keys.")] = None,
    idle_timeout_s: Annotated[float, typer.Option(help="Longest wait for the guard's next response (s).")] = 60.0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Serve an OpenAI-compatible API in front of MODEL (a stream guard) on Triton SERVER: chat
    and completions, streamed or not; bearer keys map to the guard's tenants."""
    argv = front_argv(server, model, host, port, tokenizer, keys_file, idle_timeout_s, log_level)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)  # never returns
