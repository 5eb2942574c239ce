"""The ``generator`` Python-based backend: a decoupled text generator with the vLLM backend's I/O.

Inputs ``text_input`` (BYTES [1], UTF-8), optional ``stream`` (BOOL [1]), ``sampling_parameters``
(BYTES [1], a JSON object: ``max_tokens``, ``temperature``, ``top_p``, ``seed``) and
``exclude_input_in_output`` (BOOL [1]); output ``text_output`` (BYTES) (:mod:`.contract`). With
``stream`` true every generated character is one response and a flags-only COMPLETE_FINAL closes
the stream; otherwise one response carries the whole text (prefixed by the prompt unless
``exclude_input_in_output``, as vLLM does).

The artifact (see ``examples/generator.py``) is one recurrent step in ONNX with explicit state
(:mod:`.decoder`). ``execute()`` only validates and enqueues; one decode thread per instance
(:mod:`.engine`) prefills new prompts and advances every in-flight sequence with one batched call
per token.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tritonguard.core.config import from_params, model_parameters
from tritonguard.core.errors import ConfigError, TritonGuardError
from tritonguard.generation.contract import (
    INPUTS,
    OUTPUT,
    STOP_PREFIX,
    parse_sampling,
    read_contract,
    stop_dir,
)
from tritonguard.generation.decoder import CharTokenizer, Decoder, Sequence, StepModel
from tritonguard.generation.engine import Engine, generation_metrics
from tritonguard.triton import backend as triton
from tritonguard.triton.streams import ResponseSink, send_safely

log = logging.getLogger(__name__)


# -- Triton ---------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class GeneratorConfig:
    """config.pbtxt ``parameters`` of a ``generator`` model."""

    max_tokens_cap: int = 256
    default_max_tokens: int = 16
    max_prompt_chars: int = 8192
    max_active: int = 16
    max_queue: int = 256
    intra_op_threads: int = 1
    cancel_poll_ms: int = 50
    # ITL: one observation per streamed token (one pb_utils IPC each in the flusher) instead of
    # one per request (its mean); see docs/generation.md "Metrics"
    itl_per_token: bool = False

    def __post_init__(self) -> None:
        for name in ("max_tokens_cap", "default_max_tokens", "max_prompt_chars", "max_active",
                     "max_queue", "intra_op_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"parameter '{name}' must be >= 1, got {getattr(self, name)}")
        if self.cancel_poll_ms < 0:
            raise ValueError(f"parameter 'cancel_poll_ms' must be >= 0, got {self.cancel_poll_ms}")


def parse_request(inputs: Mapping[str, np.ndarray], cfg: GeneratorConfig) -> Sequence:
    """The request's inputs -> a :class:`Sequence`; any rule broken raises InvalidInput."""
    prompt, stream, exclude, raw_sp = read_contract(inputs, max_prompt_chars=cfg.max_prompt_chars)
    params = parse_sampling(raw_sp, max_tokens_cap=cfg.max_tokens_cap, default_max_tokens=cfg.default_max_tokens)
    return Sequence(prompt, params, stream=stream, prepend_prompt=not stream if exclude is None else not exclude)


def _request_id(request: Any) -> str:
    try:
        return str(request.request_id() or "")
    except Exception:  # noqa: BLE001 - an id is optional
        return ""


class GeneratorModel:
    def initialize(self, args: dict[str, str]) -> None:
        a = triton.prologue(args)
        self.name = a.name
        if not a.decoupled:
            raise ConfigError(f"model '{self.name}': backend 'generator' needs "
                              "model_transaction_policy { decoupled: true }")
        self.config = from_params(GeneratorConfig, model_parameters(a.config), model=self.name)
        version_dir = a.version_dir
        try:
            tok = CharTokenizer.from_dict(json.loads((version_dir / "vocab.json").read_text()))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model '{self.name}': cannot read {version_dir / 'vocab.json'}: {exc}") from None
        model = StepModel(version_dir / "model.onnx", self.config.intra_op_threads)
        self.metrics = generation_metrics(self.name, a.version)
        self.engine = Engine(Decoder(model, tok), max_active=self.config.max_active,
                             max_queue=self.config.max_queue,
                             cancel_poll_s=self.config.cancel_poll_ms / 1000, name=self.name,
                             metrics=self.metrics, itl_per_token=self.config.itl_per_token,
                             stop_dir=stop_dir())
        log.info("generator %s v%s: vocab %d, hidden %d, max_tokens_cap %d", self.name,
                 a.version, tok.vocab_size, model.hidden, self.config.max_tokens_cap)

    def execute(self, requests: list[Any]) -> None:
        received = time.perf_counter()
        for request in requests:
            sink = ResponseSink(request, OUTPUT)
            rid = _request_id(request)
            if rid.startswith(STOP_PREFIX):  # a caller stops one of its generations: no text
                self.engine.relay_stop(rid[len(STOP_PREFIX):])
                send_safely(sink.finish, None)
                continue
            try:
                seq = parse_request(triton.request_inputs(request, INPUTS), self.config)
            except TritonGuardError as exc:
                self.metrics.inc("gen_requests", outcome="rejected")
                send_safely(sink.fail, str(exc), exc.code)
                continue
            except Exception as exc:  # noqa: BLE001 - never let a traceback reach clients
                log.exception("generator %s: request rejected", self.name)
                self.metrics.inc("gen_requests", outcome="rejected")
                send_safely(sink.fail, f"model '{self.name}' cannot read the request: {type(exc).__name__}", "INTERNAL")
                continue
            seq.sink, seq.received, seq.request_id = sink, received, rid
            self.engine.submit(seq)
        return None

    def finalize(self) -> None:
        self.engine.stop()
        self.metrics.close()
        if self.engine.stop_dir is not None:
            try:  # the server's stop files: gone once no model of it uses them (a caller recreates it)
                self.engine.stop_dir.rmdir()
            except OSError:
                pass
