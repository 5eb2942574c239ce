"""The output README's rollout walk-through shows is what the commands print (issue 45 item 5:
promote's lines, the labels gate's wording and status had drifted from the code).

Each shown block is compared with what the formatting code prints for the walk's situation, built
from fixed inputs (no server, no training): ``route``'s state summary, the offline judge's line,
the gates' step lines, promote's last line, and status's rollout section. Numbers are the variable
part (they differ from run to run): every number on both sides is replaced by ``N`` before the
comparison, so any change of wording fails here while another run's figures do not. A shown line
must come out of the code in the order shown; ``…`` stands for lines left out, and lines that
are not the command's own (``uniq -c`` counts, logging, the status table) are named below.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from exporter.cli.status import print_live
from exporter.rollout.gates.config import GateConfig
from exporter.rollout.gates.evaluate import evaluate
from exporter.rollout.gates.readings import GuardReadings
from exporter.rollout.gates.reasons import golden_reason
from exporter.rollout.gates.verdict import GateResult
from exporter.rollout.judge import OfflineJudgement, upper_bound
from exporter.rollout.progress import evidence, passed_on
from exporter.rollout.route import state_summary
from tritonguard.rollout.judging import SOURCES

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
FALLBACK = ["candidate", "primary", "previous_primary", "default"]


def norm(line: str) -> str:
    return NUMBER.sub("N", line.rstrip())


def shown_block(starts: str) -> list[str]:
    """The lines of README's plain (output) block whose first line starts with ``starts``."""
    text = README.read_text()
    for m in re.finditer(r"^```([^\n`]*)\n(.*?)^```", text, re.S | re.M):
        lines = m.group(2).splitlines()
        if not m.group(1).strip() and lines and lines[0].startswith(starts):
            return lines
    raise AssertionError(f"README has no output block starting with {starts!r}")


def assert_shown(shown: list[str], printed: list[str]) -> None:
    """Every shown line (but ``…``) is a printed line, numbers aside, in the order printed."""
    want = [norm(x) for x in printed]
    at = 0
    for line in shown:
        if line.strip() in ("…", ""):
            continue
        n = norm(line)
        assert n in want[at:], f"README shows\n  {line}\nwhich the code does not print (here) among\n  " + \
            "\n  ".join(printed)
        at = want.index(n, at) + 1


def _state(revision: int, candidate: dict | None, goldens: dict, breakers: dict) -> dict:
    return {"revision": revision, "primary": {"version": 1}, "candidate": candidate, "shadow_share": 0.0,
            "fallback": FALLBACK, "goldens": goldens, "breakers": breakers}


def _golden(diff: float) -> dict:
    result = {"verdict": "PASS", "metrics": {"PROBS": {"agreement": 1.0, "max_abs_diff": diff, "atol": 1e-4}}}
    return {**result, "summary": golden_reason(result)}  # as exporter.rollout.route.show adds it


GOLDEN_V1, GOLDEN_V2 = _golden(1.79e-07), _golden(5.36e-07)


def test_route_output_is_the_state_summary():
    shown = shown_block("digits r")
    routed = state_summary(_state(3, {"version": 2, "share": 0.1}, {"1": GOLDEN_V1},
                                  {"1": {"state": "closed", "trips": 0}, "2": {"state": "closed", "trips": 0}}),
                           goldens=True)
    # the second route: v2's goldens were recorded by the guard in between (its own revision)
    stopped = state_summary(_state(5, None, {"1": GOLDEN_V1, "2": GOLDEN_V2}, {"1": {"state": "closed", "trips": 0}}),
                            goldens=True)
    printed = [f"digits {routed[0]}", *(f"  {x}" for x in routed[1:]),
               f"digits {stopped[0]}", *(f"  {x}" for x in stopped[1:])]
    counts = re.compile(r"^\s+\d+ digits_raw:\d$")  # the curl loop's `uniq -c`, not route's
    assert_shown([x for x in shown if not counts.match(x)], printed)


def _judged() -> OfflineJudgement:
    """The walk's offline judgement: v2 retrained with another seed, 450 labelled rows."""
    return OfflineJudgement(judge="task", verdict="INCONCLUSIVE", data="eval.npz of v2 (450 rows, labelled)",
                            rows=450, disagreement=3 / 450, expected_disagreement=upper_bound(3, 450),
                            accuracy={"primary": 0.9844, "candidate": 0.9822}, metric="accuracy",
                            difference=-0.0022, lower=-0.0086, upper=0.0041, labelled=True, limit=0.02,
                            limit_source=SOURCES["max_disagreement"],
                            reason="too few rows to show non-inferiority offline; the live gates decide")


def _step_report(share: float):
    """The gates' report on a window at ``share`` (labels never sent, as in the walk)."""
    after = GuardReadings(model="digits", primary=1, candidate=2, served={1: 9000, 2: 1000},
                          compared={"canary": {"AGREE": 1000}}, breaker_state=0)
    samples = (None, None) if share >= 1.0 else None
    report = evaluate(None, after, GateConfig(judge="task", min_requests=100), share=share, latency_samples=samples)
    if 0.25 <= share < 1.0:  # judged on the guards' per-call samples: latency_gate's PASS (no reason)
        report.gates = [g for g in report.gates if g.name != "latency"]
        report.gates.append(GateResult(name="latency", verdict="PASS", figures={"ratio": 0.981}, samples=5000))
    return report


def _promoted(reports) -> str:
    """The controller's reason for a promotion, from the reports that moved the rollout on."""
    progress = SimpleNamespace(config={"offline": _judged().to_dict()}, judged={})
    for report in reports:
        for g in report.to_dict()["gates"]:
            if g["verdict"] == "PASS" and (what := passed_on(g)):
                progress.judged[g["name"]] = what
    return f"promoted; judged on: {evidence(progress)}"


def test_promote_output_is_the_judge_the_gates_and_the_last_line():
    shown = shown_block("INFO     'digits' v2: DRAFT -> STAGING")
    judged = _judged()
    steps = [(0.1, None), (0.5, _step_report(0.1)), (1.0, _step_report(0.5))]
    printed = [f"judge digits v2 vs v1: {judged.summary()}"]
    # promote's step line (exporter.cli.rollout_common.controller_for's on_step)
    printed += [f"→ step {i + 1}: {share:.0%}" + (f"  ({report.summary()})" if report else "")
                for i, (share, report) in enumerate(steps)]
    # its last line (rollout_common.exit_for) with the controller's reason for a promotion
    printed.append("✓ cache of digits purged (epoch 1; no shared tiers)")  # rollout_common.purge, before it
    printed.append(f"digits v2: done at step 3/3 (100 %): {_promoted([r for _, r in steps[1:]])}")
    ours = [x for x in shown if not x.startswith("INFO ")]  # logging lines: the registry's and controller's
    assert_shown(ours, printed)


def test_status_rollout_section_is_what_status_prints():
    shown = shown_block("model repository")
    report = _step_report(1.0)  # the last look, at 100 %
    gates = [{"name": g.name, "verdict": g.verdict, "samples": g.samples, "reason": g.reason} for g in report.gates]
    state = {**_state(10, None, {}, {}), "primary": {"version": 2}, "previous_primary": 1}
    guard = {"model": "digits", "target": "digits_raw", "state": state,
             "stages": {1: "ARCHIVED", 2: "PRODUCTION"}, "aliases": {"champion": 2, "production": 2},
             "rollout": {"candidate": 2, "mode": "split", "status": "done", "step": 3, "steps": [10, 50, 100],
                         "share": 1.0, "look": 4, "reason": _promoted([_step_report(0.1), _step_report(0.5)]),
                         "gates": gates},
             "metrics": {"replicas": 1, "served": {"digits_raw:1": 46856, "digits_raw:2": 41058},
                         "breaker": {"1": 0, "2": 0}, "drift": {}, "errors": {}, "unreachable": []}}
    console = Console(record=True, width=400)
    print_live(console, [guard])
    printed = console.export_text().splitlines()
    # the table above the guards (model, versions, times) is status's too, but not built here
    ours = shown[shown.index("digits → digits_raw"):]
    assert_shown(ours, printed)


def test_the_check_fails_on_a_changed_word():
    judged = _judged()
    wrong = f"judge digits v2 vs v1: {judged.summary()}".replace("accuracy candidate", "accuracy v-candidate")
    try:
        assert_shown([wrong], [f"judge digits v2 vs v1: {judged.summary()}"])
    except AssertionError:
        return
    raise AssertionError("a changed word passed")
