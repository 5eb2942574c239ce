"""Output rails that block (issue 42 item 2), measured on a real tritonserver in front of `tinylm`.

Two figures:

1. **Tokens the target generated after a block**, before and after the upstream stop. tinylm's
   greedy answer to each prompt is decoded here first (the same artifact, in process) and a word
   from its middle becomes that guard's ``rails.block_words``, so every request is blocked there;
   ``max_tokens`` is 2,000. ``rails_stop`` tells the generator to stop (the default,
   ``stop_requests``); ``rails_drain`` (``stop_requests=false``) is the behaviour before it: the
   rest is read and dropped. The guard logs the count per block; target: at most the hold-back
   window plus one batch.
2. **Time to first token added by the hold-back** at c=1 and c=8 (gRPC streaming, greedy,
   128 tokens, varied prompts; guards alternate over ``rounds`` rounds, medians): ``norails``
   (output redaction off, no rails) against ``words`` (a word list the answers never complete:
   only a possible listed word is held), ``pattern`` (a regular expression: only what may still
   grow into a match is held, by partial matching) and ``classifier`` (the example classifier
   judges each window over BLS). Target: word and pattern rules <= 5 ms at c=8. These guards run tinylm in process (``--placement inprocess``, the
   default, what docs/stream-guard.md recommends for a ``generator`` target): with ``bls`` at c=8
   the guard's stub can freeze in python_backend 24.10 (docs/stream-guard.md), as it did here.

   A classifier's first token cannot leave before the target made ``window`` tokens (and its
   call passed); a pattern's, before partial matching, not before ``window + 1``. That time is the
   window's own, not the guard's overhead: the same run also times when ``norails``'s client had
   received ``window`` and ``window + 1`` tokens (tinylm: a token is a character), and reports
   ``*_overhead_ms``, the TTFT beyond that (a pattern's now negative: it no longer waits for it).

    python -m perf.rails_bench [--rounds 3] [--json out.json] [--ttft-only] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from perf.stream_bench import JOIN_S, _client_loop, _inputs
from tritonguard.core.repository import write_config
from tritonguard.ops.server import Server

WINDOW = 16  # rails.holdback_tokens
TTFT_ADDED_MS = 5.0
BLOCK_TOKENS = 2000
TTFT_MODELS = ("norails", "words", "pattern", "classifier")


def _guard(repo: Path, name: str, io: dict, **params: str) -> None:
    params = {"target": "tinylm", "validation.max_tokens": "4096", "redaction.redact_outputs": "false", **params}
    write_config(repo / name, {"name": name, "backend": "guard", **io,
                               "parameters": {k: {"string_value": v} for k, v in params.items()},
                               "instance_group": [{"count": 1, "kind": "KIND_CPU"}]})
    (repo / name / "1").mkdir(exist_ok=True)


def build(repo: Path, prompts: list[str], steps: int | None = None, placement: str = "inprocess") -> str:
    """tinylm, the example classifier and the guards; returns the blocked word."""
    from examples import generator as example
    from examples import rails_classifier
    from tritonguard.generation.contract import SamplingParams

    example.build(repo, "tinylm", max_tokens_cap=4096, **({"steps": steps} if steps else {}))
    rails_classifier.build(repo)
    dec = example.decoder(repo / "tinylm" / "1" / "model.onnx")
    # a word that every prompt's greedy answer reaches after some tokens
    counts: dict[str, int] = {}
    for p in prompts:
        text = dec.generate(p, SamplingParams(max_tokens=400, temperature=0))
        for w in set(re.findall(r"[A-Za-z]{2,}", text[8:])):
            counts[w] = counts.get(w, 0) + 1
    word = max(counts, key=lambda w: (counts[w], w)) if counts else "the"
    io = {k: v for k, v in example.triton_config("x").items()
          if k in ("input", "output", "max_batch_size", "model_transaction_policy")}
    common = {"rails.holdback_tokens": str(WINDOW), "stream_interval_ms": "0"}
    ttft = {"placement": placement, "stream_interval_ms": "0"}  # the TTFT guards
    # the prompts are not judged here: a prompt holding the word would be refused before any token
    blocks = {"rails.block_words": word, "rails.check_prompt": "false", **common}
    _guard(repo, "rails_stop", io, **blocks)
    _guard(repo, "rails_drain", io, **{**blocks, "stop_requests": "false"})
    _guard(repo, "norails", io, **ttft)
    _guard(repo, "words", io, **{"rails.block_words": "bomb,nerve agent,weapon,poison", **common, **ttft})
    _guard(repo, "pattern", io, **{"rails.pattern.CARD": r"\b4\d{3}( \d{4}){3}\b", **common, **ttft})
    _guard(repo, "classifier", io, **{"rails.model": "rails_classifier", "rails.check_prompt": "false", **common,
                                      **ttft})
    return word


def blocked_counts(log: str, guard: str) -> list[int]:
    """Per block, the tokens the target sent after it (the guard's log)."""
    return [int(n) for n in re.findall(rf"stream guard {guard}: answer blocked by rail '[^']+' after \d+ target "
                                       r"tokens \(\d+ pieces sent\); the target sent (\d+) more after the block", log)]


def run_blocks(url: str, guard: str, prompts: list[str], concurrency: int) -> int:
    """Stream every prompt (a block is the client's error); the number blocked."""
    per = [prompts[i::concurrency] for i in range(concurrency)]
    errors: list[str] = []

    def client(ps: list[str]) -> None:
        for p in ps:
            try:
                _client_loop(url, guard, [p], BLOCK_TOKENS, [])
            except RuntimeError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=client, args=(ps,), daemon=True) for ps in per]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    other = [e for e in errors if "content_filter" not in e]
    if other:
        raise RuntimeError(f"{guard}: {other[:3]}")
    return len(errors)


def _timed_loop(url: str, model: str, prompts: list[str], tokens: int, out: list[tuple[float, ...]]) -> None:
    """One client, its prompts one after another on one gRPC stream: per answer the seconds to its
    first text and to its ``WINDOW``-th and ``WINDOW + 1``-th character (nan: never reached)."""
    import queue

    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    nan = float("nan")
    try:
        for prompt in prompts:
            t0 = time.perf_counter()
            first, at_w, at_w1, chars = nan, nan, nan, 0
            client.async_stream_infer(model, _inputs(prompt, tokens), enable_empty_final_response=True)
            while True:
                result, error = q.get(timeout=60)
                if error is not None:
                    raise RuntimeError(f"{model}: {error}")
                text = result.as_numpy("text_output")
                now = time.perf_counter() - t0
                if text is not None and text[0]:
                    chars += len(text[0].decode("utf-8", errors="replace"))
                    first = now if first != first else first
                    at_w = now if at_w != at_w and chars >= WINDOW else at_w
                    at_w1 = now if at_w1 != at_w1 and chars >= WINDOW + 1 else at_w1
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            out.append((first, at_w, at_w1))
    finally:
        client.stop_stream()
        client.close()


def measure(url: str, model: str, concurrency: int, prompts: list[str], tokens: int) -> dict[str, float]:
    """p50 ms to the first text, and to the ``WINDOW``-th and ``WINDOW + 1``-th token."""
    results: list[list[tuple[float, ...]]] = [[] for _ in range(concurrency)]
    per = [prompts[i::concurrency] for i in range(concurrency)]
    threads = [threading.Thread(target=_timed_loop, args=(url, model, per[i], tokens, results[i]), daemon=True)
               for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, t0 + JOIN_S - time.perf_counter()))
    flat = [r for rs in results for r in rs]
    if any(t.is_alive() for t in threads) or len(flat) != len(prompts):
        raise RuntimeError(f"{model} c={concurrency}: {len(flat)} of {len(prompts)} requests finished")

    def p50(i: int) -> float:
        vals = [r[i] for r in flat if r[i] == r[i]]
        return 1000 * statistics.median(vals) if vals else float("nan")

    return {"ttft_p50_ms": p50(0), "window_p50_ms": p50(1), "window1_p50_ms": p50(2)}


def run(workdir: Path, *, rounds: int = 3, concurrency: tuple[int, ...] = (1, 8), tokens: int = 128,
        steps: int | None = None, blocks: bool = True, placement: str = "inprocess") -> dict[str, Any]:
    from examples.texts import stdlib_sentences

    repo = workdir / "rails_repo"
    repo.mkdir(parents=True, exist_ok=True)
    sentences = [s[:80] for s in stdlib_sentences(64)]
    word = build(repo, sentences[:16], steps, placement)
    log_path = workdir / "rails_tritonserver.log"
    out: dict[str, Any] = {"blocked_word": word, "window": WINDOW, "placement": placement, "ttft": {},
                           "after_block": {}}
    with Server(repository=repo, log_path=log_path) as server:
        server.start(wait_models=("tinylm", "rails_classifier", "rails_stop", "rails_drain", *TTFT_MODELS))
        for guard in ("rails_drain", "rails_stop") if blocks else ():
            for c in concurrency:
                before = len(blocked_counts(server.tail(10**6), guard))
                n = run_blocks(server.grpc_url, guard, sentences[:16], c)
                deadline = time.monotonic() + 120  # the guard logs a block once the target's rest is read
                while len(counts := blocked_counts(server.tail(10**6), guard)[before:]) < n:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                if not counts:
                    raise RuntimeError(f"{guard}: no answer was blocked (the word {word!r} never came)")
                out["after_block"][f"{guard} c={c}"] = {"blocked": n, "logged": len(counts), "requests": 16,
                                                        "median": statistics.median(counts), "max": max(counts)}
                sys.stderr.write(f"{guard} c={c}: tokens after the block {out['after_block'][f'{guard} c={c}']}\n")
        for c in concurrency:
            prompts = sentences[:max(16, 8 * c)]
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in TTFT_MODELS}
            for rnd in range(rounds):
                for m in TTFT_MODELS if rnd % 2 == 0 else TTFT_MODELS[::-1]:
                    runs[m].append(measure(server.grpc_url, m, c, prompts, tokens))
                    sys.stderr.write(f"c={c} round {rnd + 1} {m}: {runs[m][-1]}\n")
            med = {m: statistics.median(r["ttft_p50_ms"] for r in v) for m, v in runs.items()}
            # the window's own time: when norails' client had the tokens a held window waits for
            w = statistics.median(r["window_p50_ms"] for r in runs["norails"])
            w1 = statistics.median(r["window1_p50_ms"] for r in runs["norails"])
            out["ttft"][str(c)] = {"p50_ms": med, "norails_window_ms": w, "norails_window1_ms": w1,
                                   **{f"{m}_added_ms": med[m] - med["norails"] for m in TTFT_MODELS[1:]},
                                   "pattern_overhead_ms": med["pattern"] - w1,
                                   "classifier_overhead_ms": med["classifier"] - w}
    stop8 = out["after_block"].get("rails_stop c=8", {}).get("max", float("inf"))
    out["meets_target"] = {"after_block": stop8 <= WINDOW + 64 if blocks else None,  # None: not measured
                           **{f"ttft_{m}_c8": out["ttft"].get("8", {}).get(f"{m}_added_ms", float("inf")) <= TTFT_ADDED_MS
                              for m in ("words", "pattern")}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.rails_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--steps", type=int, help="tinylm's training steps (default: the example's)")
    ap.add_argument("--workdir", type=Path, help="keep the repository and the server log here")
    ap.add_argument("--ttft-only", action="store_true", help="skip the tokens-after-a-block figures")
    ap.add_argument("--concurrency", type=int, action="append", help="repeat; default 1 and 8")
    ap.add_argument("--placement", choices=("inprocess", "bls"), default="inprocess",
                    help="the TTFT guards' placement (the block guards always call tinylm over BLS)")
    args = ap.parse_args(argv)
    kw = {"rounds": args.rounds, "steps": args.steps, "blocks": not args.ttft_only,
          "concurrency": tuple(args.concurrency or (1, 8)), "placement": args.placement}
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = run(args.workdir, **kw)
    else:
        with tempfile.TemporaryDirectory(prefix="rails_bench_") as tmp:
            result = run(Path(tmp), **kw)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
