"""Responses: refusals, cache hits and routed answers become the batch's Triton responses.
``SERVED_BY`` goes only to requests that ask for it (or name no outputs, and so get them all):
a BYTES tensor per response is measurable work on the hot path."""

from __future__ import annotations

import numpy as np

from tritonguard.core.tensors import offsets, split
from tritonguard.guard.config import SERVED_BY
from tritonguard.guard.pipeline import Batch, Stage
from tritonguard.triton import backend as triton


class RespondStage(Stage):
    name = "respond"
    always = True  # requests already decided (refused, cache hits) are answered even if routing failed

    def __init__(self, output_names: list[str]):
        self.output_names = output_names

    def run(self, b: Batch) -> None:
        for i, err in b.errors.items():
            b.responses[i] = triton.error(err)
        for i, outs in b.hits.items():
            if b.served_by[i]:
                outs = {**outs, SERVED_BY: np.full((b.hit_sizes[i], 1), b.cache_label.encode(), dtype=object)}
            b.responses[i] = triton.response(outs)
        routed = b.routed
        if routed is None or not b.route:
            return
        good_sizes = [b.sizes[k] for k in range(len(b.route)) if routed.errors[k] is None]
        parts = {n: split(routed.outputs[n], offsets(good_sizes)) for n in self.output_names}
        labels: dict[tuple[int, str], np.ndarray] = {}  # one SERVED_BY array per size and version
        j = 0
        for k, i in enumerate(b.route):
            err = routed.errors[k]
            if err is not None:
                b.responses[i] = triton.error(err)
                continue
            outs = {n: parts[n][j] for n in self.output_names}
            if b.served_by[i]:
                key = (b.sizes[k], routed.served_by[k])
                label = labels.get(key)
                if label is None:
                    label = labels[key] = np.full((key[0], 1), key[1].encode(), dtype=object)
                outs[SERVED_BY] = label
            b.responses[i] = triton.response(outs)
            j += 1
        if b.trace is not None:
            b.trace.mark("respond")
