"""Compute and cost per answered request (``cost.*``, see :mod:`tritonguard.observe.cost`)."""

from __future__ import annotations

from typing import Any

from tritonguard.guard.pipeline import Batch, Stage


class CostStage(Stage):
    name = "cost"

    def __init__(self, meter: Any):
        self.meter = meter

    def run(self, b: Batch) -> None:
        if b.valid:
            self.meter.record(b, b.routed, b.calls, calls_cpu_ns=b.calls_cpu_ns)

    def close(self) -> None:
        self.meter.close()
