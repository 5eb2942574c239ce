"""``exporter promote`` for a generative model behind a stream guard, on a real tritonserver under
live generation traffic (HTTP /generate and SSE /generate_stream, greedy and sampled).

The repository holds ``tinylm_raw`` (the ``generator`` backend) and its decoupled guard
``tinylm``:

- v1: the base checkpoint (200 training steps, seed 0), primary;
- v2: a degraded checkpoint, the same recipe stopped after 40 steps;
- v3: v1 re-exported (the same seed and steps: byte-identical ONNX, judged for equivalence);
- v4: an honest retrain (seed 1), judged on the task;
- v5: v1 whose logits turn NaN when one character is in its input, a character no golden prompt
  and no evaluation text holds: it passes every offline check and the goldens on the server, and
  fails on live prompts that contain it (a fault the breaker must catch);
- v6: v4 plus matrix products on its state that reach the logits only at 1e-30 (below float32
  resolution): the same text, each decode step slower (1.4-1.6x the CPU time per token here;
  served alone 1.5x the time per token here, 2.9x on the CI machine; the test measures both): a
  slow build only the latency gate can catch.

Each rollout runs as ``python -m exporter promote`` (as a user runs it) while traffic threads keep
generations in flight; the tests run in file order and share the server.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from examples import generator as example
from tritonguard.core.files import atomic_write
from tritonguard.core.repository import write_config
from tritonguard.ops.server import Server

pytestmark = pytest.mark.functional

ROOT = Path(__file__).resolve().parents[2]
GATES = ["--dwell-s", "2", "--interval-s", "1", "--min-requests", "60", "--max-error-rate", "0.05",
         "--min-compared", "40", "--min-latency-samples", "30", "--max-step-s", "120"]
# requests a second per traffic thread (3 threads). Unpaced, the threads sent 22,325 generations
# in this module's 195 s alone (304 s of CPU on 2 cores), most of them while no gate counted
# (the CLI's start and offline judging, dwells, a server starting), and in a full run that CPU
# was taken from the other lane. Paced, 7,769 (188 s of CPU): what the gates need, chiefly the
# ~230 compared rows the equivalence SPRT takes at 10 % (2026-12-01)
RATE = 10.0
WORDS = ("Return the", "Create a new", "If the", "This module", "The default", "Raise an", "A list of",
         "Open the", "Set the", "Read the", "Write a", "Call the", "Get the", "When the", "Convert a")


def graft(repo: Path, src: int, dest: int, edit: Callable[[Any], None], *, name: str = "tinylm_raw",
          into: str | None = None, **manifest: Any) -> None:
    """Version ``dest`` of the generator ``name`` (of ``into`` when given): version ``src`` of
    ``name`` whose graph ``edit`` changes (the node that wrote LOGITS now writes LOGITS_clean;
    ``edit`` adds the nodes that write LOGITS), with its vocabulary, goldens and evaluation
    texts, and its manifest updated by ``manifest`` (a None value removes the key)."""
    import hashlib

    import onnx

    s, d = repo / name / str(src), repo / (into or name) / str(dest)
    d.mkdir(parents=True)
    model = onnx.load(str(s / "model.onnx"))
    for node in model.graph.node:
        node.output[:] = ["LOGITS_clean" if o == "LOGITS" else o for o in node.output]
    edit(model)
    onnx.checker.check_model(model)
    data = model.SerializeToString()
    (d / "model.onnx").write_bytes(data)
    for file in ("vocab.json", "goldens.json", "eval.json"):
        shutil.copy(s / file, d / file)
    doc = json.loads((s / "manifest.json").read_text())
    doc.update(version=dest, sha256=hashlib.sha256(data).hexdigest(), **manifest)
    for key in [k for k, v in manifest.items() if v is None]:
        del doc[key]
    atomic_write(d / "manifest.json", json.dumps(doc, indent=1))


def poison(repo: Path, src: int, dest: int, char: str) -> None:
    """Version ``dest``: version ``src`` whose logits turn NaN whenever ``char`` is among the
    tokens of the call (a prompt holding it, or a step that writes it): a numerical fault on rare
    inputs. (NaN weights would not do: onnxruntime's GRU clamps its gate inputs, NaN included.)"""
    from onnx import TensorProto, helper

    from tritonguard.generation.decoder import CharTokenizer

    tok = CharTokenizer.from_dict(json.loads((repo / "tinylm_raw" / str(src) / "vocab.json").read_text()))
    token = tok.encode(char)[0]

    def edit(model) -> None:
        g = model.graph
        opset = max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        g.initializer.extend([helper.make_tensor("poison_token", TensorProto.INT64, [], [token]),
                              helper.make_tensor("poison_nan", TensorProto.FLOAT, [], [float("nan")]),
                              helper.make_tensor("poison_zero", TensorProto.FLOAT, [], [0.0])])
        reduce = (helper.make_node("ReduceMax", ["poison_f"], ["poison_any"], axes=[1], keepdims=1) if opset < 18 else
                  helper.make_node("ReduceMax", ["poison_f", "poison_axes"], ["poison_any"], keepdims=1))
        if opset >= 18:
            g.initializer.append(helper.make_tensor("poison_axes", TensorProto.INT64, [1], [1]))
        g.node.extend([
            helper.make_node("Equal", ["TOKENS", "poison_token"], ["poison_eq"]),
            helper.make_node("Cast", ["poison_eq"], ["poison_f"], to=TensorProto.FLOAT),
            reduce,
            helper.make_node("Cast", ["poison_any"], ["poison_b"], to=TensorProto.BOOL),
            helper.make_node("Where", ["poison_b", "poison_nan", "poison_zero"], ["poison_add"]),
            helper.make_node("Add", ["LOGITS_clean", "poison_add"], ["LOGITS"]),
        ])

    graft(repo, src, dest, edit, judge="task", equivalent_to=None,
          source="tests: v1 with NaN logits on one character")


# the slow fault's extra work per decode step: tanh(state @ W1) then tanh(. @ W2), W2 square.
# SLOW_WIDTH 384 measured 1.25-1.52x the time per token of tinylm_raw served alone (3 clients, HTTP;
# 1.12x once, in a loaded CI run); 256 measured 0.98x (lost in the noise), 448 1.43x
SLOW_WIDTH = 512


def slowed(repo: Path, src: int, dest: int, width: int = SLOW_WIDTH, **where: str) -> None:
    """Version ``dest``: version ``src`` with input-dependent work added to every decode step
    that changes no logit (it is added at 1e-30): the same answers, slower. Judged for
    equivalence, as a slower re-export of the same weights would be. ``where``: :func:`graft`'s
    ``name`` and ``into``."""
    from onnx import helper, numpy_helper

    def edit(model) -> None:
        g = model.graph
        rng = np.random.default_rng(0)
        hidden = next(i for i in g.input if i.name == "STATE").type.tensor_type.shape.dim[2].dim_value
        g.initializer.extend([
            numpy_helper.from_array((rng.normal(size=(hidden, width)) / np.sqrt(hidden)).astype(np.float32), "slow_w1"),
            numpy_helper.from_array((rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32), "slow_w2"),
            numpy_helper.from_array(np.array([0], np.int64), "slow_axis0"),
            numpy_helper.from_array(np.array([1], np.int64), "slow_axis1"),
            numpy_helper.from_array(np.array(1e-30, np.float32), "slow_scale")])
        g.node.extend([
            helper.make_node("Squeeze", ["STATE_OUT", "slow_axis0"], ["slow_h"]),
            helper.make_node("MatMul", ["slow_h", "slow_w1"], ["slow_m1"]),
            helper.make_node("Tanh", ["slow_m1"], ["slow_t1"]),
            helper.make_node("MatMul", ["slow_t1", "slow_w2"], ["slow_m2"]),
            helper.make_node("Tanh", ["slow_m2"], ["slow_t2"]),
            helper.make_node("ReduceSum", ["slow_t2", "slow_axis1"], ["slow_sum"], keepdims=1),
            helper.make_node("Mul", ["slow_sum", "slow_scale"], ["slow_add"]),
            helper.make_node("Add", ["LOGITS_clean", "slow_add"], ["LOGITS"]),
        ])

    graft(repo, src, dest, edit, judge="equivalence", equivalent_to=src,
          source=f"tests: v{src} with slower decode steps", **where)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    base = tmp_path_factory.mktemp("genrollout")
    repo = base / "repo"
    figures = {1: example.build(repo, "tinylm_raw", version=1, guard="tinylm")}
    figures[2] = example.build(repo, "tinylm_raw", version=2, steps=40)
    figures[3] = example.build(repo, "tinylm_raw", version=3)
    figures[4] = example.build(repo, "tinylm_raw", version=4, seed=1)
    # the poison: a character of the vocabulary that no golden prompt and no evaluation text holds
    tested = "".join(c["prompt"] for c in json.loads((repo / "tinylm_raw" / "1" / "goldens.json").read_text())["cases"])
    tested += "".join(json.loads((repo / "tinylm_raw" / "1" / "eval.json").read_text())["texts"]) + "".join(WORDS)
    char = next(c for c in "~^`|@#$%&" if c not in tested)
    poison(repo, 1, 5, char)
    slowed(repo, 4, 6)
    write_config(repo / "tinylm", example.stream_guard_config(
        "tinylm", "tinylm_raw", target_version="1", validation__max_tokens="256",
        routing__poll_interval_s="0.2", routing__reconcile_interval_s="0.5",
        breaker__window="200", breaker__min_requests="20", breaker__min_compared="20",
        breaker__max_error_rate="0.05", breaker__max_nan_rate="0.0", breaker__min_off_s="300"))
    server = Server(repository=repo, log_path=base / "logs" / "tritonserver.log")
    server.start(wait_models=["tinylm", "tinylm_raw"])
    yield {"repo": repo, "server": server, "figures": figures, "poison": char}
    server.stop()


def cli(ctx, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", *args, "--repository", str(ctx["repo"])],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def server_args(ctx) -> list[str]:
    return ["--server", ctx["server"].http_url, "--metrics-url", ctx["server"].metrics_url]


def state(ctx) -> dict:
    return json.loads((ctx["repo"] / "tinylm" / "rollout_state.json").read_text())


def gate_figures(ctx) -> str:
    """The last look's latency gate as the rollout recorded it (its figures: calls a side, the
    size classes with each side's median): what a failed promote's summary line leaves out."""
    r = cli(ctx, "rollout", "status", "tinylm", "--json", timeout=60)
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        return f"rollout status --json: {r.returncode} {r.stdout[-500:]} {r.stderr[-500:]}"
    gates = ((doc or {}).get("last_report") or {}).get("gates", [])
    return json.dumps([g for g in gates if g.get("name") == "latency"], default=str)[:6000]


def metrics_url(ctx) -> str:
    url = ctx["server"].metrics_url
    return url if "://" in url else f"http://{url}"


def served_total(ctx) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url(ctx), timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tritonguard_served_total{") and 'model="tinylm"' in line:
            who = line.split('served_by="', 1)[1].split('"', 1)[0]
            out[who] = out.get(who, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Traffic:
    """Generations until stopped: 3 threads, each request a fresh prompt (no cache can answer
    it), greedy 3 in 4, streamed 1 in 3; ``poison_share`` of the prompts hold the poison. Each
    thread sends at most ``rate`` requests a second (a thread behind its pace sends at once, and
    is not owed the ones it missed)."""

    def __init__(self, ctx, *, seed: int, poison_share: float = 0.0, max_s: float = 300.0, rate: float = RATE):
        self.ctx, self.seed, self.poison_share, self.max_s, self.rate = ctx, seed, poison_share, max_s, rate
        self.sent = self.ok = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in range(3)]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
            assert not t.is_alive(), "traffic thread did not stop"

    def _loop(self, k: int) -> None:
        rng = np.random.default_rng([self.seed, k])
        base = f"http://{self.ctx['server'].http_url}"
        deadline = time.monotonic() + self.max_s
        n = 0
        due = time.monotonic()
        while not self._stop.is_set() and time.monotonic() < deadline:
            due = max(due + 1.0 / self.rate, time.monotonic())
            n += 1
            prompt = f"{WORDS[rng.integers(len(WORDS))]} {rng.integers(10**6)} "
            if rng.random() < self.poison_share:
                prompt += self.ctx["poison"]
            sampling = {"max_tokens": int(rng.integers(8, 24)), "temperature": 0}
            if rng.random() < 0.25:
                sampling.update(temperature=0.8, top_p=0.95)
            stream = rng.random() < 0.33
            body = json.dumps({"text_input": prompt, "sampling_parameters": json.dumps(sampling)}).encode()
            url = f"{base}/v2/models/tinylm/generate" + ("_stream" if stream else "")
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    raw = resp.read().decode()
                ok = ('"error"' not in raw) and ("text_output" in raw)
                err = raw[:200]
            except urllib.error.HTTPError as exc:
                ok, err = False, f"HTTP {exc.code}: {exc.read()[:200]!r}"
            except OSError as exc:
                ok, err = False, f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.sent += 1
                if ok:
                    self.ok += 1
                else:
                    self.errors.append(err)
            if not ok:
                time.sleep(0.05)  # a broken server must not turn this loop into a busy one
            self._stop.wait(due - time.monotonic())

    def report(self) -> dict:
        return {"sent": self.sent, "ok": self.ok, "errors": len(self.errors), "first_errors": self.errors[:3]}


def promote_under_traffic(ctx, version: int, steps: str, *extra: str,
                          **traffic) -> tuple[subprocess.CompletedProcess, Traffic]:
    """`exporter promote tinylm --version V` as a user runs it, while generation traffic flows."""
    with Traffic(ctx, **traffic) as t:
        r = cli(ctx, "promote", "tinylm", "--version", str(version), "--steps", steps, *GATES, *extra,
                *server_args(ctx))
    print(r.stdout, r.stderr, t.report())
    return r, t


# -- tests (in order) -------------------------------------------------------------------------------
def test_the_builds_are_what_the_tests_assume(ctx):
    m = {v: json.loads((ctx["repo"] / "tinylm_raw" / str(v) / "manifest.json").read_text()) for v in range(1, 6)}
    assert m[3]["sha256"] == m[1]["sha256"] and m[3]["judge"] == "equivalence"
    assert m[2]["judge"] == m[4]["judge"] == "task"
    bpc = {v: m[v]["evaluation"]["value"] for v in (1, 2, 4)}
    print(f"bits per char: {bpc}")
    assert bpc[2] > bpc[1] * 1.03, "the degraded checkpoint should be clearly worse"
    assert abs(bpc[4] - bpc[1]) < 0.03 * bpc[1], "an honest retrain should be about as good"


def test_degraded_checkpoint_is_rolled_back_before_any_traffic(ctx):
    r = cli(ctx, "promote", "tinylm", "--version", "2", "--steps", "10,50,100", *GATES, *server_args(ctx))
    print(r.stdout, r.stderr)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rolled_back" in r.stdout and "before any traffic" in r.stdout
    assert "bits/char" in r.stdout + r.stderr
    st = state(ctx)
    assert st["primary"]["version"] == 1 and st["candidate"] is None


def test_reexport_is_promoted_under_live_generation_traffic(ctx):
    """v3 (v1 re-exported) walks 10 -> 50 -> 100 % judged for equivalence: the canary's greedy
    texts match the primary's; no client sees an error; both versions served."""
    before = served_total(ctx)
    # the agreement test at 10 % is decisive after ~230 compared rows: ~3,100 requests (greedy 3 in
    # 4, 1 in 10 to v3), counted, not timed. A full run sustained 24 requests a second here and
    # met the 120 s step deadline at 213 rows (2026-12-01); unpaced runs had taken 90-100 s. So
    # this rollout gets a faster pace (what a full run allows) and a step deadline that fits
    # the count on a loaded machine
    r, traffic = promote_under_traffic(ctx, 3, "10,50,100", "--max-step-s", "300", seed=3, rate=25.0)
    assert r.returncode == 0, r.stdout + r.stderr + "\nthe latency gate's last look: " + gate_figures(ctx)
    assert "done" in r.stdout
    st = state(ctx)
    assert st["primary"]["version"] == 3 and st["candidate"] is None
    assert st["goldens"]["3"]["verdict"] == "PASS"
    assert not traffic.errors, traffic.report()
    after = served_total(ctx)
    for v in (1, 3):
        assert after.get(f"tinylm_raw:{v}", 0) > before.get(f"tinylm_raw:{v}", 0), (before, after)
    status = cli(ctx, "rollout", "status", "tinylm")
    assert status.returncode == 0 and "tinylm v3" in status.stdout, status.stdout + status.stderr


def test_honest_retrain_is_promoted_on_the_task(ctx):
    """v4 (seed 1) writes other text than v3: judged on the task (bits per char within 3 %),
    its live disagreement is expected, and it is promoted."""
    r, traffic = promote_under_traffic(ctx, 4, "10,100", seed=4)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "task" in r.stderr
    assert state(ctx)["primary"]["version"] == 4
    assert not traffic.errors, traffic.report()


def test_nan_on_live_prompts_trips_the_breaker_and_falls_back(ctx):
    """v5 passes every offline check and its goldens; live prompts holding the poisoned character
    make it fail with non-finite logits before its first token: each such request is answered
    by the primary instead (fallback), the breaker trips, and the rollout rolls it back."""
    # the breaker judges v5 once it has seen 20 of its requests (breaker.min_requests); the
    # rollout's error-rate gate fails it at any look where its test is decisive (5 failures in 10
    # did it), dwell or not. The breaker must see its 20 before the rollout's first look, or the
    # gate rolls v5 back first and the breaker never trips: at 10 % of the traffic's 30 requests a
    # second, with a look a second, the gate won (2026-12-01, when the traffic got its pace;
    # unpaced, the breaker had won by speed alone). At 50 % of that pace v5 has its 20 in about
    # 1.3 s, and the first look that can judge it comes 3 s after the split (the breaker then
    # keeps v5 from any more traffic: the gate read 7 errors in 20 requests). The breaker wins
    # while the traffic keeps above 14 requests a second
    r, traffic = promote_under_traffic(ctx, 5, "50,100", "--interval-s", "3", seed=5, poison_share=0.3)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rolled_back" in r.stdout
    st = state(ctx)
    assert st["primary"]["version"] == 4 and st["candidate"] is None
    assert not traffic.errors, traffic.report()  # every failure of v5 was answered by v4
    text = urllib.request.urlopen(metrics_url(ctx), timeout=10).read().decode()
    assert any(line.startswith("tritonguard_breaker_trips_total{") and 'target_version="5"' in line
               and 'reason="non_finite"' in line and not line.endswith(" 0") for line in text.splitlines()), text[-2000:]
    assert any(line.startswith("tritonguard_fallbacks_total{") and 'model="tinylm"' in line
               and not line.endswith(" 0") for line in text.splitlines())


def _raw_call(ctx, version: int, prompt: str, tokens: int) -> tuple[float, float]:
    """(seconds to the first SSE event, seconds per token of the whole call) of one streamed
    generation on tinylm_raw ``version`` itself (no guard)."""
    body = json.dumps({"text_input": prompt,
                       "sampling_parameters": json.dumps({"max_tokens": tokens, "temperature": 0})}).encode()
    req = urllib.request.Request(f"http://{ctx['server'].http_url}/v2/models/tinylm_raw/versions/{version}"
                                 "/generate_stream", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as resp:
        while not resp.readline().startswith(b"data:"):
            pass
        first = time.perf_counter() - t0
        resp.read()
    return first, (time.perf_counter() - t0) / tokens


def fault_size(ctx, a: int, b: int, pairs: int = 40) -> dict[str, float]:
    """Median ratios b/a of time to first token and time per token over paired calls: 3 clients,
    each calling both versions back to back on one prompt, the order alternating. Why pairs: the
    rounds of 20 calls of one version, then 20 of the other, met different moments of the other
    lane's load in a full run, and a fault of 1.25-1.52x per token alone read under 1.10x there
    (2026-11-29, its precondition failed); a pair meets the same moment, as the guard's canary
    pairs do (:meth:`tritonguard.guard.routing.stream.TextComparator.paired_run`)."""
    ratios: list[list[tuple[float, float]]] = [[] for _ in range(3)]

    def client(k: int) -> None:
        rng = np.random.default_rng(100 + k)
        for i in range(pairs):
            tokens = int(rng.integers(8, 24))
            prompt = f"{WORDS[rng.integers(len(WORDS))]} {rng.integers(10**6)} "
            got = {v: _raw_call(ctx, v, prompt, tokens) for v in ((a, b) if (i + k) % 2 == 0 else (b, a))}
            ratios[k].append((got[b][0] / got[a][0], got[b][1] / got[a][1]))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    xs = [r for c in ratios for r in c]
    assert len(xs) == 3 * pairs, f"{len(xs)} of {3 * pairs} pairs timed (a client failed)"
    return {"ttft": float(np.median([f for f, _ in xs])), "per_token": float(np.median([t for _, t in xs]))}


def work_per_token(ctx, a: int, b: int, pairs: int = 60) -> float:
    """Median ratio b/a of the CPU time per token of this thread decoding one prompt greedily with
    each version's ONNX step (the generator backend's own :class:`Decoder`, one ORT thread, the
    pairs interleaved): the work the build adds, which no other process's load changes. The
    served ratio (:func:`fault_size`) does change with it: every token crosses four processes,
    each wake-up waits for a core the other lane holds, and that wait is the same for both
    versions, so it dilutes the fault (1.07x served in a full run, 2026-11-30, where this ratio
    read 1.40-1.59x alone and beside 3 busy loops on 2 cores)."""
    from tritonguard.generation.contract import SamplingParams
    from tritonguard.generation.decoder import CharTokenizer

    def decoder(v: int):
        d = ctx["repo"] / "tinylm_raw" / str(v)
        return example.decoder(d / example.ARTIFACT, CharTokenizer.from_dict(json.loads((d / example.VOCAB_FILE).read_text())))

    dec = {a: decoder(a), b: decoder(b)}
    rng = np.random.default_rng(7)
    ratios: list[float] = []
    for i in range(pairs):
        prompt = f"{WORDS[rng.integers(len(WORDS))]} {rng.integers(10**6)} "
        params = SamplingParams(max_tokens=int(rng.integers(8, 24)), temperature=0)
        cost: dict[int, tuple[float, str]] = {}
        for v in ((a, b) if i % 2 == 0 else (b, a)):
            c0 = time.thread_time()
            text = dec[v].generate(prompt, params)
            cost[v] = ((time.thread_time() - c0) / max(1, len(text)), text)
        assert cost[a][1] == cost[b][1], f"v{b} answers {prompt!r} differently from v{a}: {cost[b][1]!r} vs {cost[a][1]!r}"
        ratios.append(cost[b][0] / cost[a][0])
    return float(np.median(ratios))


def test_slower_build_is_rolled_back_by_the_latency_gate(ctx):
    """v6 gives v4's text, each decode step slower. Its goldens, the equivalence judge and the
    canary all pass; the latency gate, which times whole generations against generations of the
    same length, fails it at 50 % and the rollout rolls it back, with no client error."""
    assert state(ctx)["primary"]["version"] == 4
    work = work_per_token(ctx, 4, 6)
    size = fault_size(ctx, 4, 6)
    print(f"slow fault: CPU per token {work:.2f}x; served alone, time to first token {size['ttft']:.2f}x, "
          f"per token {size['per_token']:.2f}x")
    # the fault is real: each decode step does more work (SLOW_WIDTH 256 measured 0.98x served,
    # no fault at all). The floor is on the work, which the other lane's load does not dilute; the
    # served ratio it once stood on read 1.07x in a full run (2026-11-30) for a build that does
    # 1.40-1.59x the work per token here, loaded or not
    assert work >= 1.10, (work, size)
    # ... and realistic, not a wreck, as a client sees it: served, its size depends on the CPU
    # (the extra matmuls against each step's fixed costs: HTTP, Python, the KV state), paired
    # per token 1.50x on this machine under a full run's load, 2.94x on the CI machine
    # (2026-11-29, where a 2.2x ceiling failed the test with the gate never run). Under load it
    # has read 1.50x, 1.31x (beside 2 busy loops) and 1.07x (a full run, 2026-11-30), never more:
    # load has not pushed it up, so the ceiling is the side of it that load does not threaten
    assert size["per_token"] <= 4.0, (work, size)
    # through the guard the slowdown is diluted by the hops it adds per token and by the load the
    # two versions share (1.07x to 1.18x on the gate's calls in four runs at 1.21-1.27x served
    # alone): a user who allows 5 % gets it rolled back. The latency gate FAILs it, or where the
    # ratio it reads sits near 1.05x, holds it (it cannot be shown below 1.05x; before, such a
    # window PASSed and a CI run promoted v6) until the step's deadline rolls it back
    r, traffic = promote_under_traffic(ctx, 6, "50,100", "--latency-tolerance", "0.05", "--max-step-s", "60",
                                       seed=6)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "rolled_back" in r.stdout, out
    held = ("no conclusive gate within max_step_s" in out and "latency INCONCLUSIVE" in out
            and "not yet shown below 1.05x" in out and "error_rate PASS" in out and "agreement PASS" in out)
    assert "latency FAIL" in out or held, out
    st = state(ctx)
    assert st["primary"]["version"] == 4 and st["candidate"] is None
    assert st["goldens"]["6"]["verdict"] == "PASS"
    assert not traffic.errors, traffic.report()


def test_traffic_moves_to_a_runtime_outside_triton(ctx, tmp_path):
    """A version served by an OpenAI-compatible server this project does not write (`transformers
    serve`, a tiny GPT-2), declared at its URL in tinylm_raw's endpoints.json, beside the Triton
    generator (the primary, v4 in file order). First v8, declared at a URL where nothing listens
    and rolled out by `exporter promote`: every call to it fails before its first token, the
    primary answers instead (no client error), its breaker trips and the rollout rolls it back.
    Then v7 at the real server, rolled out by `exporter promote` under the same traffic: judged
    slower by the latency gate, and promoted within the tolerance its user gives (100x): traffic
    moves to it (served_by tinylm_raw:7) with no client error, and the guard's greedy answer is
    then the server's own."""
    from tests.unit.guard.stream.upstream import free_port, transformers_serve_starting

    t0 = time.monotonic()
    primary = state(ctx)["primary"]["version"]
    # the real server builds its model and starts while v8 (which never reaches it) is rolled out
    with transformers_serve_starting(tmp_path / "upstream") as (url, model, ready):
        dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
        for v, at in ((8, dead), (7, url)):
            r = cli(ctx, "endpoint", "tinylm", str(v), "--url", at, "--model", model, timeout=60)
            assert r.returncode == 0 and f"served at {at}" in r.stdout, r.stdout + r.stderr
        before = served_total(ctx)
        r, traffic = promote_under_traffic(ctx, 8, "50,100", seed=8)
        out = r.stdout + r.stderr
        assert r.returncode == 1 and "rolled_back" in r.stdout, out
        assert "INCONCLUSIVE" in out and "is served at" in out, out  # no offline run of a URL version
        assert state(ctx)["primary"]["version"] == primary and state(ctx)["candidate"] is None
        assert not traffic.errors, traffic.report()  # every failed call of v8 was answered by the primary
        text = urllib.request.urlopen(metrics_url(ctx), timeout=10).read().decode()
        assert any(line.startswith("tritonguard_breaker_trips_total{") and 'target_version="8"' in line
                   and not line.endswith(" 0") for line in text.splitlines()), text[-2000:]

        failed_s = time.monotonic() - t0
        ready()
        ready_s = time.monotonic() - t0
        # the real server, rolled out by `exporter promote` as any version is. The latency gate
        # pairs each of v7's calls with the primary's on the same prompt, sized by the primary's
        # answer (TextComparator.paired_run), and it reads this runtime 22-28x slower than tinylm
        # in Triton (a GPT-2 generating in Python against an ONNX GRU): with the default 15 %
        # tolerance it rolls v7 back at 50 % (two trials, 22.7 s each, no client error,
        # 2026-11-29). A team that moves to a slower runtime on purpose says how much slower it
        # accepts: here 100x, and the gates promote it
        split = served_total(ctx)
        r, traffic = promote_under_traffic(ctx, 7, "50,100", "--latency-tolerance", "99", seed=7)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "promoted" in r.stdout, out + "\nthe latency gate's last look: " + gate_figures(ctx)
        ratio = re.search(r"latency \(ratio ([0-9.]+)\)", r.stdout)
        assert ratio and float(ratio.group(1)) > 1.15, out  # judged slower: the default tolerance would not pass it
        st = state(ctx)
        assert st["primary"]["version"] == 7 and st["candidate"] is None
        assert not traffic.errors, traffic.report()
        after = served_total(ctx)
        assert after.get("tinylm_raw:7", 0) > split.get("tinylm_raw:7", 0) + 20, (split, after)  # the traffic moved
        assert after.get(f"tinylm_raw:{primary}", 0) > split.get(f"tinylm_raw:{primary}", 0), (split, after)
        assert after.get("tinylm_raw:8", 0) == before.get("tinylm_raw:8", 0)  # it never answered
        prompt, sampling = "Return the 4242 ", {"max_tokens": 12, "temperature": 0}
        import openai  # a test dependency (pyproject), installed by make setup
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:  # the server itself
            direct = "".join(c.choices[0].text for c in client.completions.create(
                model=model, prompt=prompt, stream=True, **sampling) if c.choices)
        guarded = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"http://{ctx['server'].http_url}/v2/models/tinylm/generate",
            data=json.dumps({"text_input": prompt, "sampling_parameters": json.dumps(sampling),
                             "exclude_input_in_output": True}).encode(),
            headers={"Content-Type": "application/json"}), timeout=60).read())["text_output"]
        assert direct and guarded == direct, (guarded, direct)
    print(f"runtime rollout test: {time.monotonic() - t0:.1f} s (to v8's rollback {failed_s:.1f} s, "
          f"transformers serve answering at {ready_s:.1f} s); "
          f"served {before} -> {after}")
