"""Validation: every request's inputs read and checked against the contract, as one batch; a
decoupled guard's generation, one at a time."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tritonguard.core.errors import InvalidInput
from tritonguard.generation.contract import SAMPLING_KEYS, parse_sampling, read_contract
from tritonguard.guard.pipeline import Batch, Generation, Stage
from tritonguard.triton import backend as triton


class ValidateStage(Stage):
    """Reads each request's inputs (one unreadable tensor fails its own request) and validates
    the batch; refused requests are answered here, the valid ones become the pending route."""

    name = "validate"

    def __init__(self, validator: Any, input_names: list[str], metrics: Any):
        self.validator, self.input_names, self.metrics = validator, input_names, metrics

    def run(self, b: Batch) -> None:
        unreadable: dict[int, InvalidInput] = {}
        if b.requests:
            b.inputs = []
            for i, r in enumerate(b.requests):
                try:
                    b.inputs.append(triton.request_inputs(r, self.input_names))
                except InvalidInput as exc:
                    b.inputs.append({})  # fails validation ("presence"); the read error replaces that below
                    unreadable[i] = exc
        verdict = self.validator.validate(b.inputs)
        for i, exc in unreadable.items():
            verdict.errors[i] = exc
        rejects: dict[str, int] = {}
        for i, err in enumerate(verdict.errors):
            if err is not None:
                b.responses[i] = triton.error(err)
                rejects[err.rule] = rejects.get(err.rule, 0) + 1
        for rule, n in rejects.items():
            self.metrics.inc("rejects", n, reason=rule)
        b.verdict = verdict
        b.route, b.sizes, b.fused = list(verdict.valid), list(verdict.sizes), verdict.fused


# -- a decoupled guard's requests (the vLLM backend's contract) --------------------------------
@dataclass(kw_only=True)
class StreamValidationConfig:
    """``validation.*``: what a request may ask for."""

    max_prompt_chars: int = 8192
    max_tokens: int = 256  # cap on sampling_parameters.max_tokens (forwarded to the target)
    default_max_tokens: int = 16
    max_temperature: float = 2.0
    sampling_keys: tuple[str, ...] = SAMPLING_KEYS  # keys a client may send

    def __post_init__(self) -> None:
        for name in ("max_prompt_chars", "max_tokens", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"parameter 'validation.{name}' must be >= 1, got {getattr(self, name)}")
        if not (self.max_temperature >= 0 and math.isfinite(self.max_temperature)):
            raise ValueError(f"parameter 'validation.max_temperature' must be a finite number >= 0, "
                             f"got {self.max_temperature}")
        unknown = sorted(set(self.sampling_keys) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"parameter 'validation.sampling_keys': unknown {', '.join(unknown)} "
                             f"(supported: {', '.join(SAMPLING_KEYS)})")
        self.sampling_keys = tuple(self.sampling_keys)


def parse_generation(inputs: Mapping[str, np.ndarray], cfg: StreamValidationConfig) -> Generation:
    """Inputs -> :class:`Generation` (prompt not redacted yet); every broken rule raises
    :class:`InvalidInput` naming the input and the rule."""
    prompt, stream, exclude, raw_sp = read_contract(inputs, max_prompt_chars=cfg.max_prompt_chars,
                                                    limit_name="validation.max_prompt_chars")
    if not prompt.strip():
        raise InvalidInput("text_input", "non-empty", "the prompt is only white space")
    params = parse_sampling(raw_sp, max_tokens_cap=cfg.max_tokens, default_max_tokens=cfg.default_max_tokens,
                            cap_name="the guard's validation.max_tokens")
    keys = params.given
    refused = [k for k in keys if k not in cfg.sampling_keys]
    if refused:
        raise InvalidInput("sampling_parameters", "allowed keys",
                           f"key '{refused[0]}' is not allowed here (validation.sampling_keys: "
                           f"{', '.join(cfg.sampling_keys) or 'none'})")
    if params.temperature > cfg.max_temperature:
        raise InvalidInput("sampling_parameters", "key 'temperature'",
                           f"must be at most {cfg.max_temperature:g} (validation.max_temperature), "
                           f"got {params.temperature:g}")
    return Generation(prompt=prompt, params=params, stream=stream, exclude=exclude, sampling_keys=keys)


def target_sampling(gen: Generation) -> str:
    """The sampling JSON the target gets: the client's keys, normalised, and always max_tokens
    (so the target never falls back to a default above the guard's cap)."""
    out: dict[str, Any] = {"max_tokens": gen.params.max_tokens}
    for key in gen.sampling_keys:
        if key != "max_tokens":
            out[key] = getattr(gen.params, key)
    return json.dumps(out)


class StreamValidateStage(Stage):
    """Reads a generation's inputs and checks them (``validation.*``): the prompt, the sampling
    parameters and the flags, each broken rule an :class:`InvalidInput` naming the input."""

    name = "validate"

    def __init__(self, input_names: tuple[str, ...], config: StreamValidationConfig):
        self.input_names, self.config = input_names, config

    def admit(self, gen: Generation) -> None:
        inputs = gen.inputs if gen.request is None else triton.request_inputs(gen.request, self.input_names)
        parsed = parse_generation(inputs or {}, self.config)
        gen.prompt, gen.params, gen.stream = parsed.prompt, parsed.params, parsed.stream
        gen.exclude, gen.sampling_keys = parsed.exclude, parsed.sampling_keys
