"""The streaming section of `make bench`: the decoupled guard in front of `tinylm`.

Builds `tinylm` (examples.generator, ~10 s of training) into a private repository with four
decoupled guards in front of it, two per placement (BLS: `tinylm_guard`, `tinylm_guard_plain`;
in process: `tinylm_guard_inprocess`, `tinylm_guard_inprocess_plain`): the first of each pair
has the defaults (prompt and output redaction, the hold-back of text that may still grow into
PII), the `_plain` one has output redaction off, so the difference is the hold-back's cost. At
concurrency 1 and 8, gRPC streaming, greedy decoding of 128 tokens from varied prompts (stdlib
sentences), raw and guarded alternate for `rounds` rounds; per point: p50 time to first token
and aggregate tokens/s. Each client sends at least 8 requests (16 at c=1, 64 at c=8): with 2 a
client, half of the p50's requests were the 8 that start together, and the in-process TTFT
added moved from -3 to +14 ms between rounds of the same build (one run of 5 rounds); with 8 a
client, -2.3 to +2.3 ms.
Targets (issue 17): TTFT added <= 5 ms at p50, tokens/s >= 0.95 of raw.
"""

from __future__ import annotations

import json
import queue
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core.repository import write_config
from tritonguard.ops.server import Server

TTFT_ADDED_MS = 5.0
JOIN_S = 300.0  # one measurement's clients must be done by then
TOKENS_RATIO = 0.95
MODELS = ("tinylm", "tinylm_guard", "tinylm_guard_plain", "tinylm_guard_inprocess", "tinylm_guard_inprocess_plain")


def build(repo: Path) -> None:
    from examples import generator as example

    example.build(repo, "tinylm")
    io = {k: v for k, v in example.triton_config("x").items()
          if k in ("input", "output", "max_batch_size", "model_transaction_policy")}
    for name, extra in (("tinylm_guard", {}), ("tinylm_guard_plain", {"redaction.redact_outputs": "false"}),
                        ("tinylm_guard_inprocess", {"placement": "inprocess"}),
                        ("tinylm_guard_inprocess_plain", {"placement": "inprocess", "redaction.redact_outputs": "false"})):
        params = {"target": "tinylm", "validation.max_tokens": "256", **extra}
        write_config(repo / name, {"name": name, "backend": "guard", **io,
                                   "parameters": {k: {"string_value": v} for k, v in params.items()},
                                   "instance_group": [{"count": 1, "kind": "KIND_CPU"}]})
        (repo / name / "1").mkdir(exist_ok=True)


def _inputs(prompt: str, tokens: int) -> list[Any]:
    import tritonclient.grpc as grpcclient

    out = []
    for name, arr, dtype in (("text_input", np.array([prompt.encode()], dtype=object), "BYTES"),
                             ("stream", np.array([True]), "BOOL"),
                             ("sampling_parameters",
                              np.array([json.dumps({"max_tokens": tokens, "temperature": 0}).encode()], dtype=object),
                              "BYTES")):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _client_loop(url: str, model: str, prompts: list[str], tokens: int, out: list[tuple[float, int]]) -> None:
    """One client: its prompts one after another on one gRPC stream; (ttft s, tokens) each."""
    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        for prompt in prompts:
            t0 = time.perf_counter()
            first, pieces = None, 0
            client.async_stream_infer(model, _inputs(prompt, tokens), enable_empty_final_response=True)
            while True:
                result, error = q.get(timeout=60)
                if error is not None:
                    raise RuntimeError(f"{model}: {error}")
                text = result.as_numpy("text_output")
                if text is not None and text[0]:
                    pieces += 1
                    first = first if first is not None else time.perf_counter() - t0
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            out.append((first if first is not None else float("nan"), tokens if first is not None else 0))
    finally:
        client.stop_stream()
        client.close()


def measure(url: str, model: str, concurrency: int, prompts: list[str], tokens: int) -> dict[str, float]:
    results: list[list[tuple[float, int]]] = [[] for _ in range(concurrency)]
    per = [prompts[i::concurrency] for i in range(concurrency)]
    # daemons, joined with a deadline: a server that stops answering fails the bench, not hangs it
    threads = [threading.Thread(target=_client_loop, args=(url, model, per[i], tokens, results[i]), daemon=True)
               for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    deadline = t0 + JOIN_S
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"{model} c={concurrency}: clients still waiting after {JOIN_S:g} s (a stream that "
                           "never ended: see docs/stream-guard.md on python_backend 24.10 and BLS streams)")
    wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    if len(flat) != len(prompts):
        raise RuntimeError(f"{model} c={concurrency}: {len(flat)} of {len(prompts)} requests finished")
    ttfts = [f for f, _ in flat if f == f]  # a generation whose first token ends it sends no text
    return {"ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else float("nan"),
            "tokens_per_s": sum(n for _, n in flat) / wall, "without_text": len(flat) - len(ttfts)}


def run(workdir: Path, *, rounds: int = 3, concurrency: tuple[int, ...] = (1, 8), tokens: int = 128,
        per_client: int = 8, min_requests: int = 16) -> dict[str, Any]:
    from examples.texts import stdlib_sentences

    repo = workdir / "stream_repo"
    repo.mkdir(parents=True, exist_ok=True)
    build(repo)
    requests = {c: max(min_requests, per_client * c) for c in concurrency}
    sentences = [s[:80] for s in stdlib_sentences(max(requests.values()))]
    points: dict[str, Any] = {}
    with Server(repository=repo, log_path=workdir / "stream_tritonserver.log") as server:
        server.start(wait_models=MODELS)
        for c in concurrency:
            prompts = sentences[:requests[c]]
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODELS}
            for rnd in range(rounds):
                order = MODELS if rnd % 2 == 0 else MODELS[::-1]
                for m in order:
                    runs[m].append(measure(server.grpc_url, m, c, prompts, tokens))
                    sys.stderr.write(f"stream c={c} round {rnd + 1} {m}: {runs[m][-1]}\n")
            med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
            raw, guard, plain = med["tinylm"], med["tinylm_guard"], med["tinylm_guard_plain"]
            local, local_plain = med["tinylm_guard_inprocess"], med["tinylm_guard_inprocess_plain"]
            points[str(c)] = {
                "median": med,
                "ttft_added_ms": guard["ttft_p50_ms"] - raw["ttft_p50_ms"],
                "ttft_added_ms_without_output_redaction": plain["ttft_p50_ms"] - raw["ttft_p50_ms"],
                "holdback_ms": guard["ttft_p50_ms"] - plain["ttft_p50_ms"],
                "tokens_ratio": guard["tokens_per_s"] / raw["tokens_per_s"],
                "inprocess_ttft_added_ms": local["ttft_p50_ms"] - raw["ttft_p50_ms"],
                "inprocess_tokens_ratio": local["tokens_per_s"] / raw["tokens_per_s"],
                "inprocess_ttft_added_ms_without_output_redaction": local_plain["ttft_p50_ms"] - raw["ttft_p50_ms"],
                "inprocess_holdback_ms": local["ttft_p50_ms"] - local_plain["ttft_p50_ms"],
                "inprocess_ttft_added_ms_rounds": [g["ttft_p50_ms"] - r["ttft_p50_ms"] for g, r in
                                                   zip(runs["tinylm_guard_inprocess"], runs["tinylm"], strict=True)],
                "ttft_added_ms_rounds": [g["ttft_p50_ms"] - r["ttft_p50_ms"] for g, r in
                                         zip(runs["tinylm_guard"], runs["tinylm"], strict=True)],
            }

    def met(p: dict[str, float], prefix: str = "") -> bool:
        return p[f"{prefix}ttft_added_ms"] <= TTFT_ADDED_MS and p[f"{prefix}tokens_ratio"] >= TOKENS_RATIO

    ok = all(met(p) for p in points.values())
    ok_inprocess = all(met(p, "inprocess_") for p in points.values())
    return {"points": points, "meets_target": ok, "meets_target_inprocess": ok_inprocess, "tokens": tokens,
            "requests": {str(c): n for c, n in requests.items()}, "rounds": rounds}


def print_result(result: dict[str, Any]) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    table = Table(title=f"stream guard vs raw tinylm (gRPC streaming, greedy, {result['tokens']} tokens, "
                        f"p50 of {'/'.join(map(str, result['requests'].values()))} requests at c="
                        f"{'/'.join(result['requests'])}, median of {result['rounds']} rounds)")
    for col in ("c", "TTFT raw", "TTFT guarded", "added", "of which hold-back", "tokens/s raw", "guarded/raw",
                "in-process: added", "in-process: of which hold-back", "in-process: /raw"):
        table.add_column(col, justify="right")
    for c, p in result["points"].items():
        m = p["median"]
        table.add_row(c, f"{m['tinylm']['ttft_p50_ms']:.1f} ms", f"{m['tinylm_guard']['ttft_p50_ms']:.1f} ms",
                      f"{p['ttft_added_ms']:+.1f} ms", f"{p['holdback_ms']:+.1f} ms",
                      f"{m['tinylm']['tokens_per_s']:,.0f}", f"{p['tokens_ratio']:.2f}",
                      f"{p['inprocess_ttft_added_ms']:+.1f} ms", f"{p['inprocess_holdback_ms']:+.1f} ms",
                      f"{p['inprocess_tokens_ratio']:.2f}")
    console = Console()
    console.print(table)
    for c, p in result["points"].items():
        console.print(f"c={c} TTFT added by round: BLS " + ", ".join(f"{x:+.1f}" for x in p["ttft_added_ms_rounds"])
                      + " ms; in process " + ", ".join(f"{x:+.1f}" for x in p["inprocess_ttft_added_ms_rounds"]) + " ms")
    for label, key in (("BLS placement", "meets_target"), ("in-process placement", "meets_target_inprocess")):
        console.print(f"targets ({label}): TTFT added <= {TTFT_ADDED_MS} ms, tokens/s >= {TOKENS_RATIO} of raw: "
                      f"{'met' if result[key] else 'NOT met'}")
