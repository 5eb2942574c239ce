"""What a microsecond of Python in a Python-backend stub costs a client at c=1, on this machine.

The guard's price at c=1 is the Python its stub runs per ``execute()`` on top of what a raw
model's stub runs. This measures the exchange rate from thread CPU in the stub to added p50 with
nothing else in the way: a throw-away repository of trivial Python models (one FP32[4] input,
dynamic batching, no delay) that each burn a fixed amount of thread CPU per ``execute()``,
inline before returning their responses, or handed to a thread of the stub after the
responses are built (``--deferred``: what moving bookkeeping off the response path would buy).
perf_analyzer (HTTP, c=1) measures them in turn, alternating ``--rounds`` times on one server.

    .venv/bin/python -m perf.python_price [--us 100 200 300 500] [--deferred 300] [--rounds 3]

It answers "how much Python may the guard run per request for a given added p50": see
docs/performance.md (the c=1 price) for a measured table and what it means for the guard.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from tritonguard.ops.launcher import perf_analyzer_run
from tritonguard.ops.server import Server

MODEL = '''\
import json
import queue
import threading
import time

import triton_python_backend_utils as pb_utils


def burn(us):
    end = time.thread_time_ns() + us * 1000
    while time.thread_time_ns() < end:
        pass


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.us = int(params["BURN_US"]["string_value"])
        self.deferred = params["DEFERRED"]["string_value"] == "1"
        self.queue = queue.SimpleQueue()
        threading.Thread(target=self._after, daemon=True).start()

    def _after(self):
        while True:
            self.queue.get()
            burn(self.us)

    def execute(self, requests):
        out = [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]) for r in requests]
        if self.us and self.deferred:
            self.queue.put(None)
        elif self.us:
            burn(self.us)
        return out
'''

CONFIG = '''\
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
dynamic_batching {{ }}
parameters {{ key: "BURN_US" value: {{ string_value: "{us}" }} }}
parameters {{ key: "DEFERRED" value: {{ string_value: "{deferred}" }} }}
'''


def build(repo: Path, inline: list[int], deferred: list[int]) -> dict[str, tuple[int, bool]]:
    """The models, ``burn0`` (no extra work) first: name -> (µs burnt, after the responses)."""
    models = {}
    for us, later in [(0, False), *((u, False) for u in inline), *((u, True) for u in deferred)]:
        name = f"burn{'_after' if later else ''}{us}"
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(MODEL)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, us=us, deferred=int(later)))
        models[name] = (us, later)
    return models


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--us", type=int, nargs="+", default=[100, 200, 300, 500],
                    help="thread CPU burnt inline per execute(), one model each")
    ap.add_argument("--deferred", type=int, nargs="*", default=[300],
                    help="thread CPU burnt on a stub thread after the responses are built")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window-ms", type=int, default=3000)
    args = ap.parse_args(argv)
    if any(u <= 0 for u in [*args.us, *args.deferred]):
        ap.error("--us and --deferred take positive microseconds")
    with tempfile.TemporaryDirectory(prefix="python-price-") as tmp:
        repo = Path(tmp) / "repo"
        models = build(repo, args.us, args.deferred)
        names = list(models)
        data = Path(tmp) / "data.json"
        data.write_text(json.dumps({"data": [{"X": [1.0, 2.0, 3.0, 4.0]}]}))
        p50: dict[str, list[float]] = {n: [] for n in names}
        with Server(repository=repo, log_path=Path(tmp) / "server.log") as server:
            server.start(wait_models=names)
            for rnd in range(args.rounds):
                for name in names:
                    row, out = perf_analyzer_run(server.http_url, name, 1, data, window_ms=args.window_ms,
                                                 trials=3, stability_pct=50, timeout=120)
                    if row is None:
                        sys.stderr.write(f"round {rnd} {name}: perf_analyzer failed:\n{out[-600:]}\n")
                        continue
                    p50[name].append(int(row["p50 latency"]) / 1000)
                    sys.stderr.write(f"round {rnd} {name:14s} p50 {p50[name][-1]:.3f} ms\n")
    if not p50[names[0]]:
        sys.stderr.write("error: the baseline model was never measured\n")
        return 1
    base = statistics.median(p50[names[0]])
    out = sys.stdout.write
    out(f"c=1, HTTP, median of {args.rounds} rounds; baseline (no extra Python) p50 {base:.3f} ms\n")
    out(f"{'model':16s} {'Python per execute':>28s} {'added p50':>10s} {'ms added per 100 µs':>20s}\n")
    for name in names[1:]:
        if not p50[name]:
            continue
        us, later = models[name]
        added = statistics.median(p50[name]) - base
        where = "after the responses" if later else "inline"
        out(f"{name:16s} {f'{us} µs {where}':>28s} {added:+10.3f} {added / us * 100:20.3f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
