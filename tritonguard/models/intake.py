"""The ``intake`` backend: hands each request's inputs on unchanged, one request at a time.

Why it exists: python_backend 24.10 reads every request's input tensors in the server process
before ``execute()`` runs, and one request whose BYTES tensor is malformed (an element that
claims more bytes than it carries, which Triton's own check lets through for the last element)
fails the whole batch there with that request's error. A guard with a dynamic batcher cannot
isolate it: its code never runs. So a guard with BYTES inputs is served as an ensemble
``<name>`` = ``<name>_intake`` -> ``<name>_guard``: the intake has no dynamic batcher, so a
malformed request fails alone (HTTP 400 naming the input), and the guard behind it batches
only tensors that Triton has already read once. Request parameters (forwarded headers such as
the tenant's) reach both steps; the ensemble prefixes errors with ``in ensemble '<name>'``.
"""

from __future__ import annotations

from typing import Any

from tritonguard.triton import backend as triton
from tritonguard.triton.streams import echo_inputs


class IntakeModel:
    def initialize(self, args: dict[str, str]) -> None:
        a = triton.prologue(args)
        if a.config.get("dynamic_batching") is not None or a.config.get("sequence_batching") is not None:
            # the intake is there to see one request per execute(); a batcher undoes that
            raise ValueError(f"model '{a.name}': the intake backend must not batch "
                             "(remove dynamic_batching from its config.pbtxt)")

    def execute(self, requests: list[Any]) -> list[Any]:
        # the input tensors go back as they came (outputs are named as the inputs): no copy
        # through numpy, nothing deserialised here
        return echo_inputs(requests)
