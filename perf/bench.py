"""`make bench`: guarded vs raw vs in-process ceiling, in one run on one machine.

For each model and concurrency the raw and the guarded model are measured back to back with
perf_analyzer against one tritonserver on loopback; the ceiling is onnxruntime in this process
at the batch size the dynamic batcher can form at that concurrency. Results go to
``perf/results/<timestamp>.json`` and ``.png``; the ratio table is printed. Absolute numbers
drift on a shared 2-core machine: read the ratios.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from perf import cost
from tritonguard.core import repository
from tritonguard.ops.launcher import perf_analyzer_run
from tritonguard.ops.server import Server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"
# guarded/raw throughput at c=16: the median of the rounds for minilm; every round for digits,
# whose ratio swung from run to run before its defaults were chosen (issue 13)
TARGETS = {"digits": 0.85, "minilm": 0.97}
EVERY_ROUND = {"digits"}
# guarded / in-process onnxruntime at batch 16 with the target's thread count: the most a c=16
# server can batch (digits' ceiling is far above any server: Triton's per-request cost rules it)
CEILING_TARGETS = {"minilm": 0.90}
P99_BUDGET_MS = 2.0  # guarded p99 may exceed raw p99 by this much at c=16
ADDED_P50_MS = {"digits": 0.3}  # guarded p50 - raw p50 at c=1 (issue 33)
# at c=16 the batched target (minilm_encoder) must get batches at least this large a fraction
# of the raw path's under the guard (issue 33: 5.4 vs 8.0 rows was the regression)
BATCH_RATIO = {"minilm": 1.0}
TUNE_P99_MS = {"minilm": 500.0, "digits": 50.0}  # the p99 budget `make bench` gives `exporter tune`
SENTENCES = 64  # varied stdlib sentences for minilm (one repeated sentence would batch unrealistically)


@dataclass
class Measurement:
    model: str
    variant: str  # guarded | raw | ceiling
    concurrency: int
    throughput: float  # inferences/s
    p50_ms: float
    p99_ms: float
    # from perf.cost, over the perf_analyzer run (None for the in-process ceiling)
    cpu_ms_per_request: float | None = None  # every process of the server
    guard_cpu_ms_per_request: float | None = None  # the guard's own stubs (guard, intake)
    target_mean_batch: float | None = None  # digits_raw / minilm_encoder: what the batcher formed


def input_data(model: str, path: Path, sentences_n: int = SENTENCES) -> Path:
    if model == "digits":
        from sklearn.datasets import load_digits

        images = load_digits().images[:16].astype(np.float32)
        data = [{"IMAGE": {"content": img.ravel().tolist(), "shape": [8, 8]}} for img in images]
    else:
        data = [{"TEXT": {"content": [text], "shape": [1]}} for text in sentences(sentences_n)]
    path.write_text(json.dumps({"data": data}))
    return path


def sentences(n: int) -> list[str]:
    from examples.texts import stdlib_sentences

    return stdlib_sentences(n)


def perf_analyzer(server: Server, model: str, concurrency: int, data: Path, window_ms: int, trials: int) -> Measurement:
    """One perf_analyzer measurement, with the server's CPU per request and the target's mean
    batch over it (perf.cost); on a noisy machine that never settles within 25 %, retry with a
    longer window and a looser stability bound rather than report nothing."""
    attempts = [(window_ms, 25), (window_ms * 2, 60), (window_ms * 2, 1000)]
    out = ""
    for window, stability in attempts:
        before = cost.snapshot(server.proc.pid, server.http_url)
        row, out = perf_analyzer_run(server.http_url, model, concurrency, data, window_ms=window, trials=trials,
                                     stability_pct=stability, timeout=600)
        out = out[-3000:]
        if row is not None:
            price = cost.price(before, cost.snapshot(server.proc.pid, server.http_url), model)
            variant = "raw" if model.endswith("_raw") else "guarded"
            return Measurement(model.removesuffix("_raw"), variant, concurrency, float(row["Inferences/Second"]),
                               float(row["p50 latency"]) / 1000, float(row["p99 latency"]) / 1000,
                               price["cpu_ms_per_request"], price["guard_cpu_ms_per_request"],
                               price["target_mean_batch"])
        sys.stderr.write(f"  {model} c={concurrency}: unstable at {stability}% over {window} ms, retrying\n")
    raise RuntimeError(f"perf_analyzer failed for {model} c={concurrency}:\n{out}")


def median_of(ms: list[Measurement]) -> Measurement:
    """Per-field median over rounds (raw and guarded alternate, so both see the same noise)."""
    def med(name: str) -> float | None:
        vals = [getattr(m, name) for m in ms if getattr(m, name) is not None]
        return float(np.median(vals)) if vals else None

    return Measurement(ms[0].model, ms[0].variant, ms[0].concurrency, med("throughput"), med("p50_ms"), med("p99_ms"),
                       med("cpu_ms_per_request"), med("guard_cpu_ms_per_request"), med("target_mean_batch"))


def ceiling(repo: Path, model: str, batch: int, seconds: float = 3.0) -> Measurement:
    """onnxruntime in this process at ``batch``: the most a server could approach."""
    import onnxruntime as ort

    target = "digits_raw" if model == "digits" else "minilm_encoder"
    cfg = repository.read_config(repo / target)
    threads = int(cfg.get("parameters", {}).get("intra_op_threads", {}).get("string_value", "1"))
    version = repository.latest_version(repo / target)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(str(repo / target / str(version) / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    if model == "digits":
        from sklearn.datasets import load_digits

        images = load_digits().images.astype(np.float32)
        feeds = [{"IMAGE": images[k * batch:(k + 1) * batch]} for k in range(4)]
    else:
        from transformers import AutoTokenizer

        tok_v = repository.latest_version(repo / "minilm_tokenizer")
        tok = AutoTokenizer.from_pretrained(str(repo / "minilm_tokenizer" / str(tok_v) / "tokenizer"))
        texts = sentences(SENTENCES)
        # the batches a server forms: ``batch`` of the benchmark's sentences, padded to the longest
        feeds = []
        for k in range(max(1, len(texts) // batch)):
            enc = tok([texts[(k * batch + i) % len(texts)] for i in range(batch)], padding="longest", return_tensors="np")
            feeds.append({"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)})
    for feed in feeds:
        sess.run(None, feed)
    lat = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(lat) < 5:
        t0 = time.perf_counter()
        sess.run(None, feeds[len(lat) % len(feeds)])
        lat.append(time.perf_counter() - t0)
    lat_ms = np.array(lat) * 1000
    return Measurement(model, "ceiling", batch, batch * len(lat) / sum(lat), float(np.percentile(lat_ms, 50)),
                       float(np.percentile(lat_ms, 99)))


def ratio_table(results: list[Measurement], concurrencies: list[int],
                rounds: dict[tuple[str, int], list[float]] | None = None) -> list[dict]:
    """One row per model and concurrency; ``rounds`` holds guarded/raw of each alternation."""
    rows = []
    by = {(m.model, m.variant, m.concurrency): m for m in results}
    for model in TARGETS:
        for c in concurrencies:
            g, r, ceil = by.get((model, "guarded", c)), by.get((model, "raw", c)), by.get((model, "ceiling", c))
            if not (g and r):
                continue
            per_round = (rounds or {}).get((model, c)) or [g.throughput / r.throughput]
            judged = min(per_round) if model in EVERY_ROUND else g.throughput / r.throughput
            ceiling_target = CEILING_TARGETS.get(model) if c == 16 else None
            rows.append({
                "model": model, "concurrency": c,
                "guarded_ips": round(g.throughput, 1), "raw_ips": round(r.throughput, 1),
                "guarded_over_raw": round(g.throughput / r.throughput, 3),
                "guarded_over_raw_rounds": [round(x, 3) for x in per_round],
                "raw_over_ceiling": round(r.throughput / ceil.throughput, 3) if ceil else None,
                "guarded_over_ceiling": round(g.throughput / ceil.throughput, 3) if ceil else None,
                "p99_guarded_ms": round(g.p99_ms, 2), "p99_raw_ms": round(r.p99_ms, 2),
                "p99_added_ms": round(g.p99_ms - r.p99_ms, 2),
                "p99_budget_ms": P99_BUDGET_MS, "meets_p99": g.p99_ms - r.p99_ms <= P99_BUDGET_MS,
                "target": TARGETS[model] if c == 16 else None,
                "target_rule": ("every round" if model in EVERY_ROUND else "median") if c == 16 else None,
                "meets_target": (judged >= TARGETS[model]) if c == 16 else None,
                "ceiling_target": ceiling_target,
                "meets_ceiling_target": (g.throughput / ceil.throughput >= ceiling_target) if ceiling_target and ceil else None,
                # the price, from the CPU counters (perf.cost): steadier than throughput
                "p50_added_ms": round(g.p50_ms - r.p50_ms, 3),
                "p50_added_budget_ms": ADDED_P50_MS.get(model) if c == 1 else None,
                "meets_p50_added": (g.p50_ms - r.p50_ms <= ADDED_P50_MS[model]) if c == 1 and model in ADDED_P50_MS else None,
                "cpu_ms_guarded": _r(g.cpu_ms_per_request), "cpu_ms_raw": _r(r.cpu_ms_per_request),
                "cpu_ms_added": _r(g.cpu_ms_per_request - r.cpu_ms_per_request)
                if g.cpu_ms_per_request is not None and r.cpu_ms_per_request is not None else None,
                "guard_stubs_cpu_ms": _r(g.guard_cpu_ms_per_request),
                "batch_guarded": _r(g.target_mean_batch, 2), "batch_raw": _r(r.target_mean_batch, 2),
                "batch_target": BATCH_RATIO.get(model) if c == 16 else None,
                "meets_batch": (g.target_mean_batch >= BATCH_RATIO[model] * r.target_mean_batch)
                if c == 16 and model in BATCH_RATIO and g.target_mean_batch and r.target_mean_batch else None,
            })
    return rows


def _fmt(x: float | None, f: str = ".3f") -> str:
    return "-" if x is None else format(x, f)


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def plot(results: list[Measurement], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in TARGETS if any(r.model == m for r in results)]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for variant, style in (("raw", "o-"), ("guarded", "s-"), ("ceiling", "^--")):
            pts = sorted((m for m in results if m.model == model and m.variant == variant), key=lambda m: m.concurrency)
            if pts:
                ax.plot([m.p99_ms for m in pts], [m.throughput for m in pts], style, label=variant)
                for m in pts:
                    ax.annotate(f"{'b' if variant == 'ceiling' else 'c'}={m.concurrency}", (m.p99_ms, m.throughput),
                                fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_title(f"{model}: throughput vs p99")
        ax.set_xlabel("p99 latency (ms)")
        ax.set_ylabel("inferences / s")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    from rich.table import Table

    from exporter.cli.consoles import console

    table = Table(title="guarded vs raw (one run, same server; ratios are what to read)")
    for col in ("model", "c", "guarded inf/s", "raw inf/s", "guarded/raw", "per round", "target",
                "guarded/ceiling", "raw/ceiling", "p99 g/r ms", f"p99 added (≤{P99_BUDGET_MS:g} ms)"):
        table.add_column(col, justify="right")
    for r in rows:
        verdict = "" if r["target"] is None else (f"≥{r['target']} {r['target_rule']} " + ("ok" if r["meets_target"] else "SHORT"))
        ceil = "" if r["guarded_over_ceiling"] is None else f"{r['guarded_over_ceiling']:.3f}"
        if r["ceiling_target"] is not None:
            ceil += f" (≥{r['ceiling_target']} " + ("ok)" if r["meets_ceiling_target"] else "SHORT)")
        p99 = f"{r['p99_added_ms']:+.2f} " + ("ok" if r["meets_p99"] else "SHORT")
        table.add_row(r["model"], str(r["concurrency"]), f"{r['guarded_ips']:.0f}", f"{r['raw_ips']:.0f}",
                      f"{r['guarded_over_raw']:.3f}", " ".join(f"{x:.2f}" for x in r["guarded_over_raw_rounds"]), verdict,
                      ceil, "" if r["raw_over_ceiling"] is None else f"{r['raw_over_ceiling']:.3f}",
                      f"{r['p99_guarded_ms']:.2f}/{r['p99_raw_ms']:.2f}", p99)
    console().print(table)
    price = Table(title="the price of guarding: server CPU per request (all processes), the guard's own "
                        "stubs, the target's mean batch, added p50")
    for col in ("model", "c", "CPU ms/req g/r", "added", "guard stubs ms/req", "target batch g/r", "p50 added ms"):
        price.add_column(col, justify="right")
    for r in rows:
        batch = f"{_fmt(r['batch_guarded'], '.2f')}/{_fmt(r['batch_raw'], '.2f')}"
        if r["meets_batch"] is not None:
            batch += " ok" if r["meets_batch"] else " SHORT"
        p50 = f"{r['p50_added_ms']:+.3f}"
        if r["meets_p50_added"] is not None:
            p50 += f" (≤{r['p50_added_budget_ms']:g} " + ("ok)" if r["meets_p50_added"] else "SHORT)")
        price.add_row(r["model"], str(r["concurrency"]), f"{_fmt(r['cpu_ms_guarded'])}/{_fmt(r['cpu_ms_raw'])}",
                      _fmt(r["cpu_ms_added"], "+.3f"), _fmt(r["guard_stubs_cpu_ms"]), batch, p50)
    console().print(price)


def print_canary(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rollout: guarded with a candidate at 10 % + 10 % shadow (c=16, one server)")
    for col in ("model", "phase", "guarded inf/s", "raw inf/s", "guarded/raw", "p99 g/r ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model"], r["phase"], f"{r['guarded_ips']:.0f}", f"{r['raw_ips']:.0f}",
                      f"{r['guarded_over_raw']:.3f}", f"{r['p99_guarded_ms']:.2f}/{r['p99_raw_ms']:.2f}")
    Console().print(table)


def run_privacy(args: argparse.Namespace, workdir: Path) -> dict:
    """Cache-hit latency per tier, redaction and shared-quota on/off throughput (perf/privacy_bench.py)."""
    from perf import privacy_bench

    window, trials = min(args.window_ms, 2000), min(args.trials, 4)
    result = privacy_bench.run(args.repository.resolve(), workdir,
                               lambda srv, name, c, data: perf_analyzer(srv, name, c, data, window, trials),
                               input_data("digits", workdir / "privacy-digits.json"))
    privacy_bench.print_privacy(result)
    return result


def run_tracing(args: argparse.Namespace, workdir: Path) -> dict:
    from perf import tracing_bench

    result = tracing_bench.run(args.repository.resolve(), workdir,
                               lambda srv, name, c, data: perf_analyzer(srv, name, c, data, args.window_ms, args.trials),
                               input_data("digits", workdir / "tracing-digits.json"), rounds=args.rounds)
    tracing_bench.print_tracing(result)
    return result


def run_stream(args: argparse.Namespace, workdir: Path) -> dict:
    """The decoupled guard in front of tinylm vs tinylm raw (perf/stream_bench.py)."""
    from perf import stream_bench

    result = stream_bench.run(workdir, rounds=args.rounds)
    stream_bench.print_result(result)
    return result


def run_kafka(args: argparse.Namespace, workdir: Path) -> dict:
    """`exporter stream` through a Kafka broker vs perf_analyzer at the same concurrency (perf/kafka_bench.py)."""
    from perf import kafka_bench

    result = kafka_bench.run(args.repository.resolve(), workdir, events=args.kafka_events)
    kafka_bench.print_result(result)
    return result


def run_rollout(args: argparse.Namespace, workdir: Path) -> dict:
    """Time to full promotion, user-visible errors and throughput during vs before (perf/rollout_bench.py)."""
    from perf import rollout_bench

    result = rollout_bench.run(args.repository.resolve(), workdir, input_data("digits", workdir / "rollout.json"))
    rollout_bench.print_rollout(result)
    return result


TUNE_LIMIT_S = 600  # `exporter tune minilm` must finish within 10 minutes on 2 cores


def run_tune(args: argparse.Namespace, workdir: Path, model: str = "minilm") -> dict:
    """`exporter tune MODEL` as a user runs it (read only, no --apply), timed: its chosen point
    against the shipped defaults (its baseline), both measured in its own run (a moved point is
    measured again back to back with the defaults: tune's confirmation)."""
    import subprocess

    folder = workdir / f"tune-{model}"
    cmd = [sys.executable, "-m", "exporter", "tune", model, "--repository", str(args.repository.resolve()),
           "--concurrency", "16", "--p99-ms", str(TUNE_P99_MS[model]), "--out", str(folder)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TUNE_LIMIT_S * 2)
    wall = time.monotonic() - t0
    report_path = folder / "tune_report.json"
    if not report_path.exists():
        return {"model": model, "ok": False, "wall_s": round(wall, 1), "error": (proc.stderr or proc.stdout)[-2000:]}
    rep = json.loads(report_path.read_text())
    base, chosen, confirm = rep["baseline"], rep["chosen"] or rep["baseline"], rep["confirm"] or {}
    # the same-run comparison: the confirmation pair when tune moved, else chosen is the baseline
    b = (confirm.get("baseline") or base)["mean_throughput"]
    c = (confirm.get("chosen") or chosen)["mean_throughput"]
    result = {"model": model, "wall_s": round(wall, 1), "limit_s": TUNE_LIMIT_S, "p99_ms": TUNE_P99_MS[model],
              "baseline_ips": b, "chosen_ips": c, "chosen": chosen["changed"], "confirmed": rep["confirmed"],
              "points": len(rep["points"]), "report": str(report_path)}
    # confirmed None: tune kept the defaults; False: its choice lost to them when measured again
    result["ok"] = proc.returncode == 0 and wall <= TUNE_LIMIT_S and rep["confirmed"] is not False
    sys.stderr.write(f"tune {model}: {wall:.0f} s (≤{TUNE_LIMIT_S}), chosen {chosen['changed']} {c} vs defaults {b} inf/s "
                     f"-> {'ok' if result['ok'] else 'SHORT'}\n")
    return result


def run_only(args: argparse.Namespace) -> int:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="tritonguard-bench-"))
    if args.only == "rollout":
        result: Any = run_rollout(args, workdir)
    elif args.only == "tune":
        result = run_tune(args, workdir)
    elif args.only == "privacy":
        result = run_privacy(args, workdir)
    elif args.only == "tracing":
        result = run_tracing(args, workdir)
    elif args.only == "stream":
        result = run_stream(args, workdir)
    elif args.only == "kafka":
        result = run_kafka(args, workdir)
    else:
        from perf import canary

        result = canary.run(args.repository.resolve(), workdir, args.models,
                            lambda srv, name, c: perf_analyzer(srv, name, c, input_data(name.removesuffix("_raw"),
                                                               workdir / "canary.json"), args.window_ms, args.trials))
        print_canary(result)
    json_path = args.out / f"{stamp}-{args.only}.json"
    json_path.write_text(json.dumps({"timestamp": stamp, args.only: result}, indent=2))
    sys.stderr.write(f"results: {json_path}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--models", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--window-ms", type=int, default=4000)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="raw/guarded alternations per point (median; digits: each)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--sentences", type=int, default=SENTENCES,
                    help="minilm: how many distinct sentences perf_analyzer cycles through (1 = one repeated "
                         "sentence, which every path batches best: equal lengths)")
    ap.add_argument("--no-canary", action="store_true", help="skip the canary 10 %% + shadow 10 %% scenario")
    ap.add_argument("--privacy", action=argparse.BooleanOptionalAction, default=True,
                    help="cache-hit latency per tier, redaction and shared-quota on/off throughput (~3 min)")
    ap.add_argument("--rollout", action=argparse.BooleanOptionalAction, default=True,
                    help="one gated rollout of digits v2 under perf_analyzer load (~4 min)")
    ap.add_argument("--tune", action=argparse.BooleanOptionalAction, default=True,
                    help="`exporter tune minilm` timed, its choice vs the shipped defaults (≤10 min)")
    ap.add_argument("--tracing", action=argparse.BooleanOptionalAction, default=True,
                    help="digits guard with tracing off / 1 %% sampled / ratio 0, alternating (~3 min)")
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                    help="the decoupled guard in front of tinylm vs raw, c=1 and 8, gRPC streaming (~3 min)")
    ap.add_argument("--kafka", action=argparse.BooleanOptionalAction, default=True,
                    help="exporter stream (Tansu broker) vs perf_analyzer on digits at c=16: events/s, e2e p50/p99")
    ap.add_argument("--kafka-events", type=int, default=20_000, help="events of the Kafka section's burst")
    ap.add_argument("--only", choices=["canary", "kafka", "privacy", "rollout", "stream", "tracing", "tune"],
                    help="run just this scenario (skips the guarded/raw sweep)")
    args = ap.parse_args(argv)
    if args.only:
        return run_only(args)

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[Measurement] = []
    rounds: dict[tuple[str, int], list[float]] = {}
    workdir = Path(tempfile.mkdtemp(prefix="tritonguard-bench-"))
    wait = [m for model in args.models for m in (model, f"{model}_raw")]
    with Server(repository=args.repository.resolve(), log_path=workdir / "tritonserver.log") as server:
        server.start(wait_models=wait)
        for model in args.models:
            data = input_data(model, workdir / f"{model}.json", args.sentences)
            for c in args.concurrency:
                # raw and guarded alternate, so both see the same machine load; median per point
                runs: dict[str, list[Measurement]] = {f"{model}_raw": [], model: []}
                for rnd in range(args.rounds):
                    # which goes first alternates too, so neither always follows the other's load
                    for name in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
                        m = perf_analyzer(server, name, c, data, args.window_ms, args.trials)
                        runs[name].append(m)
                        sys.stderr.write(f"{name:12s} c={c:<3d} {m.throughput:9.1f} inf/s  p50 {m.p50_ms:7.2f} ms  p99 {m.p99_ms:7.2f} ms\n")
                rounds[(model, c)] = [g.throughput / r.throughput for g, r in zip(runs[model], runs[f"{model}_raw"], strict=True)]
                results.extend(median_of(v) for v in runs.values())
    for model in args.models:
        for c in args.concurrency:
            results.append(ceiling(args.repository, model, c))
    rows = ratio_table(results, args.concurrency, rounds)
    canary_rows = []
    if not args.no_canary:
        from perf import canary

        canary_rows = canary.run(args.repository.resolve(), workdir, args.models,
                                 lambda srv, name, c: perf_analyzer(srv, name, c, input_data(name.removesuffix("_raw"),
                                                                    workdir / "canary.json"), args.window_ms, args.trials))
    privacy = run_privacy(args, workdir) if args.privacy else None
    tracing = run_tracing(args, workdir) if args.tracing and "digits" in args.models else None
    rollout = run_rollout(args, workdir) if args.rollout and "digits" in args.models else None
    tuned = run_tune(args, workdir) if args.tune and "minilm" in args.models else None
    stream = run_stream(args, workdir) if args.stream else None
    kafka = run_kafka(args, workdir) if args.kafka and "digits" in args.models else None
    report = {
        "privacy": privacy, "tracing": tracing, "rollout": rollout, "tune": tuned, "stream": stream, "kafka": kafka,
        "timestamp": stamp, "machine": {"cpus": os.cpu_count()},
        "settings": {"window_ms": args.window_ms, "trials": args.trials, "rounds": args.rounds, "protocol": "http",
                     "minilm_sentences": args.sentences},
        "measurements": [asdict(m) for m in results], "ratios": rows, "canary": canary_rows,
        "targets": {"guarded_over_raw_at_c16": TARGETS, "p50_added_at_c1_ms": ADDED_P50_MS,
                    "target_batch_ratio_at_c16": BATCH_RATIO, "every_round": sorted(EVERY_ROUND),
                    "guarded_over_ceiling_at_c16": CEILING_TARGETS, "p99_added_ms": P99_BUDGET_MS},
    }
    json_path = args.out / f"{stamp}.json"
    json_path.write_text(json.dumps(report, indent=2))
    plot(results, args.out / f"{stamp}.png")
    print_table(rows)
    if canary_rows:
        print_canary(canary_rows)
    sys.stderr.write(f"results: {json_path} and {json_path.with_suffix('.png')}\n")
    missed = [f"{r['model']} c={r['concurrency']}: {what}" for r in rows
              for what, ok in (("guarded/raw", r["meets_target"]), ("guarded/ceiling", r["meets_ceiling_target"]),
                               ("p99 added", r["meets_p99"] if r["concurrency"] == 16 else None),
                               ("p50 added", r["meets_p50_added"]), ("target batch", r["meets_batch"])) if ok is False]
    if tracing is not None and not tracing["meets_target"]:
        missed.append(f"tracing at 1 %: {tracing['on_1pct_over_off']:.3f} of tracing off")
    if stream is not None and not stream["meets_target"]:
        # the BLS placement (any decoupled target); a generator-backend target can run in process
        missed.append("stream guard, BLS placement: " + ", ".join(
            f"c={c} TTFT {p['ttft_added_ms']:+.1f} ms, tokens/s {p['tokens_ratio']:.2f} of raw"
            for c, p in stream["points"].items())
            + f" (in-process placement: {'met' if stream.get('meets_target_inprocess') else 'missed too'})")
    if kafka is not None and not kafka["meets_target"]:
        missed.append(f"kafka stream: {kafka['ratio']:.2f} of perf_analyzer, {kafka['lost']} lost")
    if tuned is not None and not tuned["ok"]:
        missed.append(f"tune {tuned['model']}: {tuned.get('error') or 'slower than the defaults or over time'}")
    if missed:
        sys.stderr.write("targets missed: " + "; ".join(missed) + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
