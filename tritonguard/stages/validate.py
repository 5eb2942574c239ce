"""Validation: every request's inputs read and checked against the contract, as one batch."""

from __future__ import annotations

from typing import Any

from .. import triton
from ..errors import InvalidInput
from ..pipeline import Batch, Stage


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
