"""TTFT and tokens/s through the OpenAI-compatible front vs the stream guard over gRPC vs the raw
generator (issue 42): ``python -m perf.openai_bench [--rounds 3]``. Not a test; prints a table
(docs/llm.md).

Builds ``tinylm`` into a private repository with one stream guard (``placement: inprocess``, the
placement docs/stream-guard.md recommends for a ``generator`` target), starts tritonserver and
``python -m tritonguard.llm`` on free loopback ports, then at concurrency 1 and 8 streams greedy
128-token completions from varied prompts (stdlib sentences, 16 requests at c=1, 64 at c=8):
raw ``tinylm`` and ``tinylm_guard`` over gRPC streaming (:func:`perf.stream_bench.measure`), and
the front with the official ``openai`` client (``stream: true``), the three alternating for
``rounds`` rounds; per point the p50 time to the first text and the aggregate tokens/s, medians
over the rounds. The client, the front, the server and the model share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from perf.stream_bench import JOIN_S, measure
from tritonguard.core.repository import write_config
from tritonguard.ops.server import Server, free_port

ROOT = Path(__file__).resolve().parents[1]
GUARD = "tinylm_guard"


def build(repo: Path, steps: int | None = None) -> None:
    """``steps``: tinylm's training steps (the default the example's); fewer build faster, and the
    model's size, so its speed, is the same."""
    from examples import generator as example  # noqa: PLC0415 - torch only for the build

    example.build(repo, "tinylm", **({"steps": steps} if steps else {}))
    write_config(repo / GUARD, example.stream_guard_config(GUARD, "tinylm", placement="inprocess",
                                                           validation__max_tokens="256"))
    (repo / GUARD / "1").mkdir(exist_ok=True)


def _front_client(base: str, prompts: list[str], tokens: int, out: list[tuple[float, int]]) -> None:
    import openai  # noqa: PLC0415

    client = openai.OpenAI(base_url=base, api_key="bench", max_retries=0, timeout=60)
    for prompt in prompts:
        t0 = time.perf_counter()
        first = None
        for chunk in client.completions.create(model=GUARD, prompt=prompt, max_tokens=tokens, temperature=0,
                                               stream=True):
            if chunk.choices and chunk.choices[0].text:
                first = first if first is not None else time.perf_counter() - t0
        # counted as the gRPC clients of perf.stream_bench count: max_tokens per answer with text
        out.append((first if first is not None else float("nan"), tokens if first is not None else 0))
    client.close()


def measure_front(base: str, concurrency: int, prompts: list[str], tokens: int) -> dict[str, float]:
    results: list[list[tuple[float, int]]] = [[] for _ in range(concurrency)]
    threads = [threading.Thread(target=_front_client, args=(base, prompts[i::concurrency], tokens, results[i]),
                                daemon=True) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, t0 + JOIN_S - time.perf_counter()))
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"front c={concurrency}: clients still waiting after {JOIN_S:g} s")
    wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    ttfts = [f for f, _ in flat if f == f]
    return {"ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else float("nan"),
            "tokens_per_s": sum(n for _, n in flat) / wall, "without_text": len(flat) - len(ttfts)}


def run(workdir: Path, *, rounds: int = 3, concurrency: tuple[int, ...] = (1, 8), tokens: int = 128,
        steps: int | None = None) -> dict[str, Any]:
    from examples.texts import stdlib_sentences  # noqa: PLC0415

    repo = workdir / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    build(repo, steps)
    requests = {c: max(16, 8 * c) for c in concurrency}
    sentences = [s[:80] for s in stdlib_sentences(max(requests.values()))]
    points: dict[str, Any] = {}
    with Server(repository=repo, log_path=workdir / "tritonserver.log") as server:
        server.start(wait_models=("tinylm", GUARD))
        port = free_port()
        with open(workdir / "front.log", "wb") as log:
            front = subprocess.Popen([sys.executable, "-m", "tritonguard.llm", "--server", server.grpc_url,
                                      "--model", GUARD, "--port", str(port), "--log-level", "warning"],
                                     cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{port}/v1"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    if front.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the front did not start: {(workdir / 'front.log').read_text()}") from None
                    time.sleep(0.2)
            for c in concurrency:
                prompts = sentences[:requests[c]]
                runs: dict[str, list[dict[str, float]]] = {"raw": [], "guard": [], "front": []}
                for rnd in range(rounds):
                    order = ("raw", "guard", "front") if rnd % 2 == 0 else ("front", "guard", "raw")
                    for what in order:
                        if what == "front":
                            r = measure_front(base, c, prompts, tokens)
                        else:
                            r = measure(server.grpc_url, "tinylm" if what == "raw" else GUARD, c, prompts, tokens)
                        runs[what].append(r)
                        sys.stderr.write(f"openai c={c} round {rnd + 1} {what}: {r}\n")
                points[str(c)] = {w: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for w, rs in runs.items()}
        finally:
            front.terminate()
            try:
                front.wait(10)
            except subprocess.TimeoutExpired:
                front.kill()
    return {"points": points, "tokens": tokens, "rounds": rounds, "requests": {str(c): n for c, n in requests.items()}}


def print_result(result: dict[str, Any]) -> None:
    sys.stdout.write(f"greedy {result['tokens']} tokens, p50 TTFT and aggregate tokens/s, median of "
                     f"{result['rounds']} rounds\n\n")
    sys.stdout.write("| c | TTFT raw | TTFT guard (gRPC) | TTFT front | front added vs guard | tokens/s raw | "
                     "guard | front | front/guard |\n|---|---|---|---|---|---|---|---|---|\n")
    for c, p in result["points"].items():
        raw, guard, front = p["raw"], p["guard"], p["front"]
        sys.stdout.write(
            f"| {c} | {raw['ttft_p50_ms']:.1f} ms | {guard['ttft_p50_ms']:.1f} ms | {front['ttft_p50_ms']:.1f} ms | "
            f"{front['ttft_p50_ms'] - guard['ttft_p50_ms']:+.1f} ms | {raw['tokens_per_s']:,.0f} | "
            f"{guard['tokens_per_s']:,.0f} | {front['tokens_per_s']:,.0f} | "
            f"{front['tokens_per_s'] / guard['tokens_per_s']:.2f} |\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.openai_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--steps", type=int, help="tinylm's training steps (default: the example's)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="openai_bench_") as tmp:
        result = run(Path(tmp), rounds=args.rounds, steps=args.steps)
    print_result(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
