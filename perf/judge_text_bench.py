"""The rollout judge on a text model: a genuine minilm fine-tune and its broken twin, live.

    python -m perf.judge_text_bench [--dwell-s 10] [--interval-s 2] [--labels pairs|texts]

One tritonserver on loopback serves a private repository with minilm v1 (the packaged
all-MiniLM-L6-v2) and two candidates trained here (`examples.minilm_candidates`): the genuine
fine-tune (40 steps of in-batch contrastive learning on stdlib name-summary pairs) and its broken
twin (the same recipe on shuffled pairs). With ``--labels pairs`` every version carries the
381 held-out name-summary pairs as its evaluation set (recall@10 is judged offline); with
``--labels texts`` only their texts (unlabelled: the operator's cosine floor and disagreement limit
decide). Under traffic of varied stdlib sentences (4 client threads, one sentence a request), each
candidate goes through `python -m exporter promote minilm --version N` with the default steps and
gates; between runs v1 is primary again. Results: ``perf/results/judge-text-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from perf.judge_bench import RESULTS, _cli

console = Console(soft_wrap=True, markup=False, highlight=False)


class TextTraffic:
    """Varied sentences to ``model`` over HTTP from ``threads`` clients until stopped."""

    def __init__(self, url: str, sentences: list[str], *, threads: int = 4, model: str = "minilm", max_s: float = 1800):
        self.url, self.sentences, self.model, self.max_s = url, sentences, model, max_s
        self.sent = self.ok = 0
        self.errors: list[str] = []
        self.served: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(threads)]

    def __enter__(self) -> TextTraffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _run(self, k: int) -> None:
        import numpy as np  # noqa: PLC0415
        import tritonclient.http as httpclient  # noqa: PLC0415
        from tritonclient.utils import InferenceServerException  # noqa: PLC0415

        client = httpclient.InferenceServerClient(self.url)
        outputs = [httpclient.InferRequestedOutput("EMBEDDING"), httpclient.InferRequestedOutput("SERVED_BY")]
        n, deadline = k, time.monotonic() + self.max_s
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                text = self.sentences[n % len(self.sentences)]
                n += len(self._threads)
                inp = httpclient.InferInput("TEXT", [1, 1], "BYTES")
                inp.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
                try:
                    r = client.infer(self.model, [inp], outputs=outputs, timeout=60)
                except InferenceServerException as exc:
                    with self._lock:
                        self.sent += 1
                        self.errors.append(str(exc))
                    continue
                who = r.as_numpy("SERVED_BY")[0, 0].decode()
                with self._lock:
                    self.sent += 1
                    self.ok += 1
                    self.served[who] = self.served.get(who, 0) + 1
        finally:
            client.close()

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {"sent": self.sent, "ok": self.ok, "errors": len(self.errors), "served": dict(self.served),
                    "first_errors": self.errors[:3]}


def _texts_only(spec: Any) -> Any:
    """The spec with its evaluation queries and their summaries as unlabelled texts."""
    import numpy as np  # noqa: PLC0415

    queries = spec.eval_inputs["TEXT"].reshape(-1)
    docs = np.asarray(spec.eval_labels, dtype=object).reshape(-1)
    spec.eval_inputs = {"TEXT": np.concatenate([queries, docs]).reshape(-1, 1)}
    spec.eval_labels = None
    return spec


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from examples import minilm_candidates as mc  # noqa: PLC0415
    from examples.texts import stdlib_sentences  # noqa: PLC0415
    from exporter.build.export import export  # noqa: PLC0415
    from tritonguard.ops.server import Server  # noqa: PLC0415

    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="judge-text-bench-"))
    repo = work / "repo"
    shape = (lambda s: s) if args.labels == "pairs" else _texts_only
    v: dict[str, int] = {}
    for name, fn in (("v1", mc.base_with_eval), ("finetuned", mc.finetuned_with_eval), ("broken", mc.broken_with_eval)):
        t0 = time.monotonic()
        v[name] = export(shape(fn()), name="minilm", repository=repo, source=f"examples.minilm_candidates:{name}").version
        console.print(f"exported {name} as v{v[name]} ({time.monotonic() - t0:.0f} s)")
    pinned = _cli(repo, "route", "minilm", "--primary", str(v["v1"]))
    if pinned.returncode != 0:
        raise RuntimeError(f"route --primary failed: {pinned.stderr}")
    server = Server(repository=repo, log_path=work / "tritonserver.log", env=dict(os.environ))
    server.start(wait_models=["minilm"])
    sentences = stdlib_sentences(2000, seed=1)
    rows = []
    try:
        for name in ("finetuned", "broken"):
            _cli(repo, "route", "minilm", "--primary", str(v["v1"]), "--candidate", "0")
            time.sleep(1.0)
            t0 = time.monotonic()
            with TextTraffic(server.http_url, sentences) as traffic:
                r = _cli(repo, "promote", "minilm", "--version", str(v[name]), "--dwell-s", str(args.dwell_s),
                         "--interval-s", str(args.interval_s), "--server", server.http_url,
                         "--metrics-url", server.metrics_url)
            progress_file = repo / "minilm" / "rollout_controller.json"
            p = json.loads(progress_file.read_text()) if progress_file.exists() else {}
            judge_line = next((ln for ln in r.stderr.splitlines() if ln.startswith("judge ")), "")
            rep = traffic.report()
            row = {"candidate": name, "labels": args.labels, "exit": r.returncode,
                   "outcome": "rolled back before traffic" if "before any traffic" in r.stdout else p.get("status", "?"),
                   "offline": judge_line[:700], "last_line": (r.stdout.strip().splitlines() or [""])[-1][:700],
                   "candidate_requests": rep["served"].get(f"minilm_raw:{v[name]}", 0), "requests": rep["sent"],
                   "user_errors": rep["errors"], "seconds": round(time.monotonic() - t0, 1)}
            rows.append(row)
            console.print(json.dumps(row, indent=1))
    finally:
        server.stop()
    return {"when": dt.datetime.now().isoformat(timespec="seconds"), "dwell_s": args.dwell_s,
            "interval_s": args.interval_s, "runs": rows, "work": str(work)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dwell-s", type=float, default=10.0)
    ap.add_argument("--interval-s", type=float, default=2.0)
    ap.add_argument("--labels", choices=("pairs", "texts"), default="pairs")
    args = ap.parse_args()
    result = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"judge-text-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.write_text(json.dumps(result, indent=1))
    console.print(f"results: {out}")


if __name__ == "__main__":
    main()
