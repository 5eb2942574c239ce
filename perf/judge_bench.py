"""The rollout judge on genuine candidates, with the default steps and gates, under real traffic.

    python -m perf.judge_bench [--retrain-runs 10] [--dwell-s 10] [--interval-s 2]
                               [--users labelled,unlabelled,feedback] [--only NAME,...]

For each kind of user, one tritonserver on loopback serves a private repository: digits v1
(`examples.digits:build`) and the candidates of `examples.candidates` / `examples.faults`. The
*labelled* user exports them with their labelled evaluation sets and labels every fourth request;
the *unlabelled* one has sample inputs only, and no labels anywhere; the *feedback* one has no
labels at export but sends request ids, and their labels come later through `exporter feedback`
(promote --min-labels). For each candidate, traffic of load_digits images (8 in flight) runs while
`python -m exporter promote digits --version N` walks it through the default steps (1, 5, 10, 25,
50, 100 %) with the default gates; between runs the primary is put back to v1. The honest retrains (seeds 1, 2,
3, in turn) are promoted ``--retrain-runs`` times in a row. Per candidate it reports the outcome,
the reason, the step and the candidate requests served before the decision, user-visible errors
and the candidate's wrong answers. Results: ``perf/results/judge-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

console = Console(soft_wrap=True, markup=False, highlight=False)
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"


class LabelledTraffic:
    """load_digits images in random order over HTTP from ``threads`` client threads (one request
    in flight each), every fourth request carrying its true label (request parameter ``label``),
    until stopped or ``max_s`` passed. Counts answers, errors, and per serving version the
    answers whose top-1 was wrong. With ``rate``, each thread sends at most that many requests a
    second (a thread behind its pace sends at once and is not owed the ones it missed); without,
    as fast as the server answers."""

    def __init__(self, url: str, images: np.ndarray, labels: np.ndarray, *, max_s: float = 900.0,
                 seed: int = 0, threads: int = 8, model: str = "digits", label_every: int = 4,
                 ids: bool = False, rate: float | None = None):
        self.url, self.images, self.labels, self.max_s = url, images, labels, max_s
        self.rate = rate
        self.model = model
        self.seed = seed
        # every label_every-th request carries its label (0: none); with ids, every request gets
        # an id and its true label waits in ``answered`` for a later `exporter feedback`
        self.label_every, self.ids = label_every, ids
        self.answered: dict[str, int] = {}
        self.sent = self.ok = 0
        self.errors: list[str] = []
        self.served: dict[str, int] = {}
        self.wrong: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(threads)]

    def __enter__(self) -> LabelledTraffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        if any(t.is_alive() for t in self._threads):
            raise RuntimeError("traffic thread did not stop")

    def _run(self, k: int) -> None:
        import tritonclient.http as httpclient  # noqa: PLC0415
        from tritonclient.utils import InferenceServerException  # noqa: PLC0415

        rng = np.random.default_rng((self.seed, k))
        # a client per thread: geventhttpclient's connections belong to the thread that made them
        client = httpclient.InferenceServerClient(self.url)
        outputs = [httpclient.InferRequestedOutput("PROBS"), httpclient.InferRequestedOutput("SERVED_BY")]
        n = 0
        due = time.monotonic()
        try:
            deadline = time.monotonic() + self.max_s
            while not self._stop.is_set() and time.monotonic() < deadline:
                if self.rate:
                    if self._stop.wait(due - time.monotonic()):
                        break
                    due = max(due + 1.0 / self.rate, time.monotonic())
                i = int(rng.integers(0, len(self.images)))
                inp = httpclient.InferInput("IMAGE", [1, 8, 8], "FP32")
                inp.set_data_from_numpy(self.images[i][None])
                params = {"label": int(self.labels[i])} if self.label_every and n % self.label_every == 0 else None
                rid = f"{self.seed}-{k}-{n}" if self.ids else ""
                n += 1
                try:
                    r = client.infer(self.model, [inp], parameters=params, outputs=outputs, timeout=30,
                                     request_id=rid)
                except InferenceServerException as exc:
                    with self._lock:
                        self.sent += 1
                        self.errors.append(str(exc))
                    continue
                who = r.as_numpy("SERVED_BY")[0, 0].decode()
                wrong = int(r.as_numpy("PROBS")[0].argmax()) != int(self.labels[i])
                with self._lock:
                    self.sent += 1
                    self.ok += 1
                    self.served[who] = self.served.get(who, 0) + 1
                    if rid:
                        self.answered[rid] = int(self.labels[i])
                    if wrong:
                        self.wrong[who] = self.wrong.get(who, 0) + 1
        finally:
            client.close()

    def take_answered(self) -> dict[str, int]:
        """The ids answered since the last call, with their true labels (to feed back later)."""
        with self._lock:
            out, self.answered = self.answered, {}
        return out

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {"sent": self.sent, "ok": self.ok, "errors": len(self.errors), "served": dict(self.served),
                    "wrong": dict(self.wrong), "first_errors": self.errors[:3]}


class LabelFeeder:
    """Labels that arrive after the answers: every ``interval_s`` the ids ``traffic`` got answered
    since the last round, with their true labels, go into a CSV that ``python -m exporter
    feedback`` joins (a subprocess, as an operator runs it). ``rounds`` keeps each run's counts."""

    def __init__(self, traffic: LabelledTraffic, repo: Path, model: str = "digits", *, interval_s: float = 3.0,
                 delay_s: float = 1.5):
        self.traffic, self.repo, self.model = traffic, repo, model
        self.interval_s, self.delay_s = interval_s, delay_s
        self.rounds: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LabelFeeder:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        # the label files are kept only as long as the feeder runs (they once piled up in /tmp)
        with tempfile.TemporaryDirectory(prefix="labels-") as tmp:
            self._feed(Path(tmp))

    def _feed(self, folder: Path) -> None:
        k = 0
        while not self._stop.wait(self.interval_s):
            answered = self.traffic.take_answered()
            if not answered:
                continue
            # the guards publish what they answered about once a second: a label may come sooner
            # than its answer is in the store, as in production; wait a little, as a reviewer would
            self._stop.wait(self.delay_s)
            k += 1
            path = folder / f"labels-{k}.csv"
            path.write_text("request_id,label\n" + "".join(f"{rid},{lab}\n" for rid, lab in answered.items()))
            r = _cli(self.repo, "feedback", self.model, "--labels", str(path), "--json", timeout=120)
            if r.returncode in (0, 1) and r.stdout.strip():
                self.rounds.append(json.loads(r.stdout))
            else:
                self.failures.append(f"exit {r.returncode}: {r.stderr.strip()[-300:]}")

    def joined(self) -> int:
        return sum(r["joined"] for r in self.rounds)


def install_unchecked(repo: Path, target: str, version: int, primary: int, build_artifact, golden: np.ndarray,
                      golden_out: np.ndarray) -> Path:
    """Place a version the exporter would refuse (its artifact via ``build_artifact(dir)``, a
    manifest copied from ``primary``'s, 4-row goldens) as a user could by hand."""
    from tritonguard.core.repository import GOLDENS, MANIFEST, read_manifest  # noqa: PLC0415

    vdir = repo / target / str(version)
    vdir.mkdir(parents=True)
    art = Path(build_artifact(vdir))
    manifest = read_manifest(repo / target / str(primary)) or {}
    manifest.pop("evaluation", None)
    manifest.update(version=version, sha256=hashlib.sha256(art.read_bytes()).hexdigest(), judge="task",
                    source="installed by hand")
    (vdir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    np.savez(vdir / GOLDENS, in__IMAGE=golden, out__PROBS=golden_out)
    return vdir


def _cli(repo: Path, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", *args, "--repository", str(repo)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


USERS = ("labelled", "unlabelled", "feedback")


def _plan(user: str, retrain_runs: int) -> list[str]:
    """The candidates a user meets: retrains (seeds 1, 2, 3 in turn) ``retrain_runs`` times, then faults."""
    plan = [("retrain" if k % 3 == 0 else f"retrain{k % 3 + 1}") for k in range(retrain_runs)]
    if user == "labelled":
        return plan + ["worse", "worse5pp", "one_class_fault", "nan_subset", "raises_above_batch", "slow13", "slow2",
                       "loose"]
    if user == "unlabelled":
        return plan + ["worse5pp", "worse"]
    return plan + ["worse5pp"]


def _unlabelled(spec: Any) -> Any:
    """The spec as a user with only sample inputs exports it: no evaluation set."""
    import dataclasses  # noqa: PLC0415

    return dataclasses.replace(spec, eval_inputs=None, eval_labels=None, eval_slices=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One server and repository per user kind: ``labelled`` (labelled evaluation sets, every fourth
    request labelled), ``unlabelled`` (sample inputs only, no labels anywhere), ``feedback``
    (sample inputs only; every request carries an id and its label arrives later through
    `exporter feedback`, with ``promote --min-labels``)."""
    rows = []
    for user in args.users.split(","):
        if user not in USERS:
            raise SystemExit(f"--users: {user!r} is not one of {', '.join(USERS)}")
        rows += _run_user(user, args)
    return {"when": dt.datetime.now().isoformat(timespec="seconds"), "dwell_s": args.dwell_s,
            "interval_s": args.interval_s, "runs": rows}


def _run_user(user: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from examples import candidates, digits, faults  # noqa: PLC0415
    from exporter.build.export import export  # noqa: PLC0415
    from tritonguard.ops.server import Server  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix=f"judge-bench-{user}-"))
    repo = work / "repo"
    v: dict[str, int] = {}
    sources = {"v1": digits.build, "retrain": candidates.retrain, "retrain2": candidates.retrain2,
               "retrain3": candidates.retrain3, "worse": candidates.worse, "worse5pp": candidates.worse5pp,
               "one_class_fault": candidates.one_class_fault, "nan_subset": faults.nan_subset,
               "slow13": candidates.slow13, "slow2": candidates.slow2, "loose": candidates.loose}
    plan = _plan(user, args.retrain_runs)
    if args.only:
        plan = [p for p in plan if p in args.only.split(",")]
    for name, fn in sources.items():
        if name != "v1" and name not in plan:
            continue
        spec = fn() if user == "labelled" else _unlabelled(fn())
        v[name] = export(spec, name="digits", repository=repo, source=name).version
        console.print(f"[{user}] exported {name} as v{v[name]}")
    if "raises_above_batch" in plan:
        v["raises_above_batch"] = max(v.values()) + 1
        golden = faults.load_all()[0][:4]
        install_unchecked(repo, "digits_raw", v["raises_above_batch"], v["v1"],
                          candidates.raises_above_batch_artifact, golden,
                          candidates.run_in_chunks(candidates.trained(0)[0], golden))
    images, labels = faults.load_all()
    # the guard pins the newest version on disk as primary on its first load: pin v1 first
    pinned = _cli(repo, "route", "digits", "--primary", str(v["v1"]))
    if pinned.returncode != 0:
        raise RuntimeError(f"route --primary failed: {pinned.stderr}")
    server = Server(repository=repo, log_path=work / "tritonserver.log", env=dict(os.environ))
    server.start(wait_models=["digits", "digits_raw"])
    rows = []
    try:
        for k, name in enumerate(plan):
            _cli(repo, "route", "digits", "--primary", str(v["v1"]), "--candidate", "0")
            time.sleep(1.0)
            t0 = time.monotonic()
            extra = ["--min-labels", str(args.min_labels)] if user == "feedback" else []
            traffic = LabelledTraffic(server.http_url, images, labels, seed=k,
                                      label_every=4 if user == "labelled" else 0, ids=user == "feedback")
            feeder = LabelFeeder(traffic, repo) if user == "feedback" else None
            with traffic:
                if feeder is not None:
                    feeder.__enter__()
                try:
                    r = _cli(repo, "promote", "digits", "--version", str(v[name]), "--dwell-s", str(args.dwell_s),
                             "--interval-s", str(args.interval_s), *extra, "--server", server.http_url,
                             "--metrics-url", server.metrics_url)
                finally:
                    if feeder is not None:
                        feeder.__exit__(None, None, None)
            took = time.monotonic() - t0
            progress_file = repo / "digits" / "rollout_controller.json"
            p = json.loads(progress_file.read_text()) if progress_file.exists() else {}
            before_traffic = "before any traffic" in r.stdout
            rep = traffic.report()
            who = f"digits_raw:{v[name]}"
            last = (r.stdout.strip().splitlines() or [""])[-1]
            row = {"user": user, "candidate": name, "version": v[name], "exit": r.returncode,
                   "outcome": "rolled back before traffic" if before_traffic else p.get("status", "?"),
                   "step": None if before_traffic else p.get("steps", [0])[p.get("step_index", 0)],
                   "reason": last[:600], "candidate_requests": rep["served"].get(who, 0),
                   "candidate_wrong": rep["wrong"].get(who, 0), "requests": rep["sent"], "user_errors": rep["errors"],
                   "labels_joined": feeder.joined() if feeder is not None else None, "seconds": round(took, 1)}
            rows.append(row)
            console.print(json.dumps(row))
    finally:
        server.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--retrain-runs", type=int, default=10)
    ap.add_argument("--dwell-s", type=float, default=10.0)
    ap.add_argument("--interval-s", type=float, default=2.0)
    ap.add_argument("--only", default="", help="comma-separated candidate names to run (default: all)")
    ap.add_argument("--users", default=",".join(USERS), help=f"which users to play: {', '.join(USERS)}")
    ap.add_argument("--min-labels", type=int, default=150, help="feedback user: promote --min-labels")
    args = ap.parse_args()
    result = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"judge-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.write_text(json.dumps(result, indent=1))
    console.print(f"\n{'user':<11}{'candidate':<17}{'outcome':<28}{'step':>6}{'cand req':>10}{'wrong':>7}{'errors':>8}"
                  f"{'s':>7}  reason")
    for row in result["runs"]:
        console.print(f"{row['user']:<11}{row['candidate']:<17}{row['outcome']:<28}{row['step'] or '-':>6}"
                      f"{row['candidate_requests']:>10}{row['candidate_wrong']:>7}{row['user_errors']:>8}"
                      f"{row['seconds']:>7}  {row['reason'][:160]}")
    console.print(f"results: {out}")


if __name__ == "__main__":
    main()
