"""Feedback (``feedback.*``): what each version answered, for labels that arrive later, and the
labels that came with the request. See :mod:`tritonguard.rollout.feedback`.

Runs after the responses are built, for the answered requests only; a batch where no request
carries an id or a ``label`` parameter costs one pass over the request ids. Nothing here can
fail a request: the recorder buffers and drops (counted) rather than wait."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import numpy as np

from tritonguard.core.tensors import offsets
from tritonguard.guard.pipeline import Batch, Stage
from tritonguard.rollout.feedback import (
    CACHE,
    FALLBACK,
    LABEL,
    MODEL,
    PRED,
    Label,
    Prediction,
    digest,
    parse_label,
)
from tritonguard.triton import backend as triton

log = logging.getLogger(__name__)


def label_of(params: Any) -> tuple[int, ...] | None:
    """The ground truth a client sent with a request (request parameter ``label``: a class id,
    or ids separated by commas for a request of several rows), or None. A label that does not
    parse is ignored, never an error (it is feedback, not an input)."""
    return parse_label(params.get("label")) if params else None


def _version(served_by: str) -> tuple[int, str] | None:
    """``digits_raw:2`` -> (2, model); ``cache:digits_raw:2`` -> (2, cache); None if unparsable."""
    source = CACHE if served_by.startswith("cache:") else MODEL
    _, _, v = served_by.rpartition(":")
    return (int(v), source) if v.isdigit() else None


class FeedbackStage(Stage):
    name = "feedback"
    always = True  # cache hits and answers of a batch whose later stage failed were still answered

    def __init__(self, recorder: Any, metrics: Any, *, output: str, classifier: bool, sample: float = 1.0,
                 rng: random.Random | None = None, clock: Any = time.time):
        self.recorder, self.metrics = recorder, metrics
        self.output, self.classifier, self.sample = output, classifier, sample
        self.rng = rng or random.Random()
        self.clock = clock

    def run(self, b: Batch) -> None:
        ids = [triton.request_id(r) for r in b.requests] if b.requests else [""] * len(b.params)
        labels = {i: lab for i, p in enumerate(b.params) if p and (lab := label_of(p)) is not None}
        wanted = [i for i, rid in enumerate(ids) if (rid or i in labels) and i not in b.errors]
        if not wanted:
            return
        now = self.clock()
        preds: list[Prediction] = []
        labelled: list[Label] = []
        counts: dict[tuple[str, str], int] = {}
        for i, out, served_by, source in self._answers(b, set(wanted)):
            found = _version(served_by)
            if found is None or self.output not in out:
                continue
            version, path = found
            arr = np.asarray(out[self.output])
            rows = len(arr) if arr.ndim else 1
            answer: tuple[int, ...] | bytes = (tuple(int(x) for x in arr.reshape(rows, -1).argmax(axis=1))
                                               if self.classifier else digest(arr))
            src = CACHE if path == CACHE else source
            tenant = b.tenants[i] if i < len(b.tenants) else ""
            rid = ids[i]
            truth = labels.get(i)
            if truth is not None and self.classifier and len(truth) == rows:
                labelled.append(Label(tenant, rid, now, version, src, truth, answer,  # type: ignore[arg-type]
                                      str(b.params[i].get("slice") or ""), "request"))
                for t, p in zip(truth, answer, strict=True):  # type: ignore[arg-type]
                    key = (str(version), "true" if t == p else "false")
                    counts[key] = counts.get(key, 0) + 1
            if rid and (self.sample >= 1.0 or self.rng.random() < self.sample):
                preds.append(Prediction(tenant, rid, now, version, src, answer))
        for (version, right), k in counts.items():
            self.metrics.inc("labeled", k, target_version=version, correct=right)
        if self.recorder is not None:
            if preds:
                self.recorder.add(PRED, preds)
            if labelled:
                self.recorder.add(LABEL, labelled)

    @staticmethod
    def _answers(b: Batch, wanted: set[int]):
        """(request, its outputs, SERVED_BY, source) of the answered requests in ``wanted``."""
        for i in wanted & set(b.hits):
            yield i, b.hits[i], b.cache_label, CACHE
        routed = b.routed
        if routed is None or not b.route or not wanted & set(b.route):
            return
        good = [k for k in range(len(b.route)) if routed.errors[k] is None]
        starts = offsets([b.sizes[k] for k in good])
        for j, k in enumerate(good):
            i = b.route[k]
            if i in wanted:
                out = {n: v[starts[j]:starts[j + 1]] for n, v in routed.outputs.items()}
                yield i, out, routed.served_by[k], FALLBACK if k in routed.fallbacks else MODEL

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
