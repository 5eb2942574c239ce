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
   only a possible listed word is held), ``pattern`` (a regular expression: the whole window is
   held) and ``classifier`` (the example classifier judges each window over BLS). Target: word
   rules <= 5 ms at c=8.

    python -m perf.rails_bench [--rounds 3] [--json out.json]
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

from perf.stream_bench import _client_loop, measure
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


def build(repo: Path, prompts: list[str], steps: int | None = None) -> str:
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
    # the prompts are not judged here: a prompt holding the word would be refused before any token
    blocks = {"rails.block_words": word, "rails.check_prompt": "false", **common}
    _guard(repo, "rails_stop", io, **blocks)
    _guard(repo, "rails_drain", io, **{**blocks, "stop_requests": "false"})
    _guard(repo, "norails", io, stream_interval_ms="0")
    _guard(repo, "words", io, **{"rails.block_words": "bomb,nerve agent,weapon,poison", **common})
    _guard(repo, "pattern", io, **{"rails.pattern.CARD": r"\b4\d{3}( \d{4}){3}\b", **common})
    _guard(repo, "classifier", io, **{"rails.model": "rails_classifier", "rails.check_prompt": "false", **common})
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


def run(workdir: Path, *, rounds: int = 3, concurrency: tuple[int, ...] = (1, 8), tokens: int = 128,
        steps: int | None = None) -> dict[str, Any]:
    from examples.texts import stdlib_sentences

    repo = workdir / "rails_repo"
    repo.mkdir(parents=True, exist_ok=True)
    sentences = [s[:80] for s in stdlib_sentences(64)]
    word = build(repo, sentences[:16], steps)
    log_path = workdir / "rails_tritonserver.log"
    out: dict[str, Any] = {"blocked_word": word, "window": WINDOW, "ttft": {}, "after_block": {}}
    with Server(repository=repo, log_path=log_path) as server:
        server.start(wait_models=("tinylm", "rails_classifier", "rails_stop", "rails_drain", *TTFT_MODELS))
        for guard in ("rails_drain", "rails_stop"):
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
            runs: dict[str, list[float]] = {m: [] for m in TTFT_MODELS}
            for rnd in range(rounds):
                for m in TTFT_MODELS if rnd % 2 == 0 else TTFT_MODELS[::-1]:
                    runs[m].append(measure(server.grpc_url, m, c, prompts, tokens)["ttft_p50_ms"])
                    sys.stderr.write(f"c={c} round {rnd + 1} {m}: TTFT p50 {runs[m][-1]:.1f} ms\n")
            med = {m: statistics.median(v) for m, v in runs.items()}
            out["ttft"][str(c)] = {"p50_ms": med, **{f"{m}_added_ms": med[m] - med["norails"]
                                                      for m in TTFT_MODELS[1:]}}
    stop8 = out["after_block"].get("rails_stop c=8", {}).get("max", float("inf"))
    out["meets_target"] = {"after_block": stop8 <= WINDOW + 64,
                           "ttft_words_c8": out["ttft"].get("8", {}).get("words_added_ms", float("inf")) <= TTFT_ADDED_MS}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.rails_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--steps", type=int, help="tinylm's training steps (default: the example's)")
    ap.add_argument("--workdir", type=Path, help="keep the repository and the server log here")
    args = ap.parse_args(argv)
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = run(args.workdir, rounds=args.rounds, steps=args.steps)
    else:
        with tempfile.TemporaryDirectory(prefix="rails_bench_") as tmp:
            result = run(Path(tmp), rounds=args.rounds, steps=args.steps)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
