"""Redaction: PII in text inputs before the cache keys and the target see them, and in text
outputs before responses, the cache and the audit do (``redaction.*``); for a decoupled guard,
in the prompt and across the pieces of the answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tritonguard.guard.pipeline import Batch, Stage, starts_of
from tritonguard.privacy.redaction import StreamRedactor


def redact_rows(redactor: Any, metrics: Any, label: Callable[[str], str], arr: np.ndarray,
                row_tenants: Sequence[str], direction: str) -> tuple[np.ndarray, np.ndarray]:
    """Redacted copy of a BYTES array (rows = first axis), and which rows changed. Spans are
    counted per tenant on the ``redactions`` metric."""
    n = len(arr)
    groups: dict[str, list[int]] = {}
    for r, t in enumerate(row_tenants):
        groups.setdefault(t, []).append(r)
    if len(groups) <= 1:
        red, counts = redactor.redact_bytes_array(arr)
        per_tenant = [(row_tenants[0] if n else "", counts)]
    else:
        red = np.empty_like(arr)
        per_tenant = []
        for t, rows in groups.items():
            idx = np.asarray(rows)
            part, counts = redactor.redact_bytes_array(arr[idx])
            red[idx] = part
            per_tenant.append((t, counts))
    for t, counts in per_tenant:
        for kind, k in counts.items():
            metrics.inc("redactions", k, type=kind, direction=direction, tenant=label(t))
    if red is arr:
        return arr, np.zeros(n, bool)
    flat_a, flat_r = arr.reshape(n, -1), red.reshape(n, -1)
    changed = np.fromiter((any(a is not b for a, b in zip(ra, rr, strict=True))
                           for ra, rr in zip(flat_a, flat_r, strict=True)), bool, count=n)
    return red, changed


class RedactInStage(Stage):
    """The pending requests' text inputs, redacted: always what the cache and the audit key on;
    what the target sees too unless ``redaction.model_sees_redacted`` is false."""

    name = "redact.input"

    def __init__(self, redactor: Any, text_inputs: list[str], model_sees_redacted: bool, batched: bool,
                 metrics: Any, label: Callable[[str], str]):
        self.redactor, self.text_inputs = redactor, text_inputs
        self.model_sees_redacted, self.batched = model_sees_redacted, batched
        self.metrics, self.label = metrics, label

    def admit(self, gen: Any) -> None:
        """A generation's prompt, redacted before the target, the caches and the audit see it
        (with ``model_sees_redacted`` false: left as it is)."""
        if not self.model_sees_redacted:
            return
        (red,), counts = self.redactor.redact_batch([gen.prompt])
        if counts:
            gen.prompt = red
            gen.redacted_in = sum(counts.values())
            self.metrics.inc("stream_redactions", gen.redacted_in, direction="input")

    def run(self, b: Batch) -> None:
        if not b.route:
            return
        if not self.batched:
            # one request per execute (no batch axis): the arrays are the request's
            i = b.route[0]
            fused = dict(b.fused)
            t = b.tenants[i]
            for name in self.text_inputs:
                red, counts = self.redactor.redact_bytes_array(fused[name])
                for kind, k in counts.items():
                    self.metrics.inc("redactions", k, type=kind, direction="input", tenant=self.label(t))
                if red is not fused[name] and counts:
                    b.redacted.add(i)
                if self.model_sees_redacted:
                    fused[name] = red
            b.fused = fused
        else:
            starts = starts_of(b.sizes)
            row_changed = np.zeros(starts[-1], bool)
            row_tenants = [b.tenants[i] for i, n in zip(b.route, b.sizes, strict=True) for _ in range(n)]
            key_inputs = dict(b.fused)
            for name in self.text_inputs:
                red, changed = redact_rows(self.redactor, self.metrics, self.label, b.fused[name], row_tenants, "input")
                key_inputs[name] = red
                row_changed |= changed
            for j, i in enumerate(b.route):
                if row_changed[starts[j]:starts[j + 1]].any():
                    b.redacted.add(i)
            b.key_inputs = key_inputs
            if self.model_sees_redacted:
                b.fused = key_inputs
        if b.trace is not None:
            b.trace.mark("redact", **{"tritonguard.redact.direction": "input"})


class RedactOutStage(Stage):
    """The routed requests' text outputs, redacted in place (before responses and the cache). A
    generation's answer on its way to the client: a stream across token boundaries, holding back
    what may still grow into a match (:class:`StreamRedactor`, at most ``holdback`` characters);
    a whole answer at once."""

    name = "redact.output"

    def __init__(self, redactor: Any, text_outputs: list[str], metrics: Any, label: Callable[[str], str], *,
                 holdback: int = 0):
        self.redactor, self.text_outputs = redactor, text_outputs
        self.metrics, self.label, self.holdback = metrics, label, holdback

    def run(self, b: Batch) -> None:
        routed = b.routed
        if routed is None or not b.route:
            return
        good = [k for k in range(len(b.route)) if routed.errors[k] is None]
        if good:
            row_tenants = [b.tenants[b.route[k]] for k in good for _ in range(b.sizes[k])]
            for name in self.text_outputs:
                arr = routed.outputs.get(name)
                if arr is None or arr.dtype.kind not in "OSU" or len(arr) != len(row_tenants):
                    continue
                routed.outputs[name], _ = redact_rows(self.redactor, self.metrics, self.label, arr,
                                                      row_tenants, "output")
        if b.trace is not None:
            b.trace.mark("redact", **{"tritonguard.redact.direction": "output"})

    # -- a generation (the stream half) --------------------------------------------------------
    def _stream(self, gen: Any) -> StreamRedactor:
        """This answer's redactor: a new one when a fallback starts the answer over (what the
        failed call's redactor held back is dropped with it)."""
        held = gen.out_redactor
        if held is None or held[0] != gen.attempt:
            gen.out_redactor = held = (gen.attempt, StreamRedactor(self.redactor, self.holdback))
        return held[1]

    def piece(self, gen: Any, text: str) -> str:
        return self._stream(gen).feed(text) if text else text

    def finish(self, gen: Any, rest: str) -> str:
        if gen.stream:
            out = self._stream(gen)
            if rest:
                rest = out.feed(rest)
            rest += out.flush()
            n = sum(out.counts.values())
        else:
            (rest,), counts = self.redactor.redact_batch([rest])
            n = sum(counts.values())
        gen.redacted_out = n
        if n:
            self.metrics.inc("stream_redactions", n, direction="output")
        return rest
