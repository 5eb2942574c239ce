"""The guard's own Python cost, without Triton: ``execute()`` of the `digits` guard against the
`runtime` backend's ``execute()`` on the same requests, in this process, CPU time per batch.

Triton's stub types (``triton_python_backend_utils``) exist only inside a running stub, so a
minimal stand-in provides what the two backends call (tensors, requests, responses, errors, and
metric families that drop their values: the guard's in-process counting runs as in a stub). This
is a stand-in for measurement only: every behaviour is tested against the real server. What the
server adds per request (IPC, the dynamic batcher, HTTP) is the same for both models and is not
here, so the ratio below is far lower than guarded/raw throughput; its use is to see what a change
to the guard's Python costs, without the ±5 % noise of perf_analyzer on 2 shared cores.

    .venv/bin/python -m perf.inprocess [--batch 8] [--profile]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _stand_in() -> types.ModuleType:
    class TritonError:
        UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

        def __init__(self, msg, code=1):
            self.msg, self.code = msg, code

    class Tensor:
        __slots__ = ("n", "a")

        def __init__(self, n, a):
            self.n, self.a = n, a

        def as_numpy(self):
            return self.a

        def name(self):
            return self.n

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None, parameters=None):
            self.output_tensors, self.error = output_tensors, error

    class _Metric:
        def increment(self, value):
            pass

        def set(self, value):
            pass

        def observe(self, value):
            pass

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = range(3)

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels=None, buckets=None):  # noqa: N802 - pb_utils' name
            return _Metric()

    pb = types.ModuleType("triton_python_backend_utils")
    pb.TritonError, pb.Tensor, pb.InferenceResponse = TritonError, Tensor, InferenceResponse
    pb.MetricFamily = MetricFamily
    pb.get_input_tensor_by_name = lambda r, n: r.tensors.get(n)
    return pb


class _Trace:
    def get_context(self):
        return ""


class _Request:
    def __init__(self, pb, x):
        self.tensors = {"IMAGE": pb.Tensor("IMAGE", x)}

    def parameters(self):
        return "{}"

    def requested_output_names(self):
        return []

    def trace(self):
        return _Trace()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    ap.add_argument("--batch", type=int, default=8, help="requests of one image per execute()")
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile the guard, top 25 by own time")
    args = ap.parse_args(argv)
    pb = _stand_in()
    sys.modules["triton_python_backend_utils"] = pb
    from sklearn.datasets import load_digits  # noqa: PLC0415

    from tritonguard.core.repository import mirror, read_config  # noqa: PLC0415
    from tritonguard.guard.model import GuardModel  # noqa: PLC0415
    from tritonguard.models.runtime import RuntimeModel  # noqa: PLC0415

    repo = mirror(args.repository.resolve(), Path(tempfile.mkdtemp(prefix="inprocess-")) / "repo")

    def init(model, name):
        model.initialize({"model_config": json.dumps(read_config(repo / name)), "model_name": name,
                          "model_version": "1", "model_repository": str(repo / name),
                          "model_instance_name": f"{name}_0", "model_instance_kind": "CPU"})
        return model

    guard, raw = init(GuardModel(), "digits"), init(RuntimeModel(), "digits_raw")
    images = load_digits().images.astype(np.float32)
    batches = [[_Request(pb, images[(k * args.batch + j) % len(images)][None]) for j in range(args.batch)]
               for k in range(200)]

    def cpu_us(model, n):
        for b in batches[:50]:
            model.execute(b)
        t0 = time.process_time()
        for k in range(n):
            model.execute(batches[k % len(batches)])
        return (time.process_time() - t0) / n * 1e6

    runs: dict[str, list[float]] = {"raw": [], "guard": []}
    for _ in range(args.rounds):
        runs["raw"].append(cpu_us(raw, args.batches))
        runs["guard"].append(cpu_us(guard, args.batches))
    r, g = float(np.median(runs["raw"])), float(np.median(runs["guard"]))
    sys.stdout.write(f"batch {args.batch}: runtime {r:.0f} µs, guard {g:.0f} µs CPU per execute() (median of "
                     f"{args.rounds}); the guard adds {(g - r) / args.batch:.1f} µs per request\n")
    if args.profile:
        import cProfile  # noqa: PLC0415
        import pstats  # noqa: PLC0415

        prof = cProfile.Profile()
        prof.runcall(cpu_us, guard, args.batches)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    guard.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
