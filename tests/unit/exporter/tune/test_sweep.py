"""``exporter tune`` without a server: the pipeline it finds, its search space and pruning, the
objective, the coordinate descent, and what ``--apply`` writes (and refuses to)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from exporter.cli.tune_cmd import _summary, tune_command
from exporter.tune import sweep as tune
from exporter.tune.apply import apply_configs
from exporter.tune.knobs import (
    GUARD_DELAY,
    GUARD_INSTANCES,
    PREFERRED,
    TARGET_DELAY,
    TARGET_INSTANCES,
    TARGET_THREADS,
    TuneError,
    conflicts,
    point_key,
    with_knobs,
)
from exporter.tune.search import CoordinateDescent, Objective, Point, Stat
from tritonguard.core import repository

IO = {"input": [{"name": "IMAGE", "data_type": "TYPE_FP32", "dims": [8, 8]}],
      "output": [{"name": "PROBS", "data_type": "TYPE_FP32", "dims": [10]}]}
TEXT_IO = {"input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
           "output": [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": [384]}]}


def params(**kv):
    return {k: {"string_value": str(v)} for k, v in kv.items()}


def batched(count=1, delay=500):
    db = {"max_queue_delay_microseconds": delay} if delay else {}
    return {"max_batch_size": 64, "instance_group": [{"kind": "KIND_CPU", "count": count}], "dynamic_batching": db}


def step(model, ins, outs):
    return {"model_name": model, "model_version": -1, "input_map": ins, "output_map": outs}


def digits_repo(root: Path, *, guard_extra=None, target_extra=None) -> Path:
    repository.write_config(root / "digits_raw", {"name": "digits_raw", "backend": "runtime", **IO, **batched(),
                                                  "parameters": params(intra_op_threads=1), **(target_extra or {})})
    guard = {"name": "digits", "backend": "guard", **IO, **batched(),
             "parameters": params(target="digits_raw", placement="inprocess", **{"validation.range.IMAGE": "0,16"}),
             **(guard_extra or {})}
    repository.write_config(root / "digits", {k: v for k, v in guard.items() if v is not None})
    return root


def minilm_repo(root: Path) -> Path:
    ids = {"input_ids": "input_ids"}
    for name in ("minilm_raw", "minilm_raw_v1", "minilm_raw_v2"):
        repository.write_config(root / name, {"name": name, "platform": "ensemble", "max_batch_size": 64, **TEXT_IO,
                                              "ensemble_scheduling": {"step": [
                                                  step("minilm_tokenizer", {"TEXT": "TEXT"}, ids),
                                                  step("minilm_encoder", ids, {"sentence_embedding": "EMBEDDING"})]}})
    repository.write_config(root / "minilm_tokenizer", {"name": "minilm_tokenizer", "backend": "tokenizer",
                                                        "input": TEXT_IO["input"],
                                                        "output": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]}],
                                                        **batched()})
    repository.write_config(root / "minilm_encoder", {
        "name": "minilm_encoder", "backend": "runtime", **batched(),
        "input": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]}],
        "output": [{"name": "sentence_embedding", "data_type": "TYPE_FP32", "dims": [384]}],
        "parameters": params(intra_op_threads=2)})
    repository.write_config(root / "minilm_intake", {"name": "minilm_intake", "backend": "intake", "max_batch_size": 64,
                                                     "input": TEXT_IO["input"], "output": TEXT_IO["input"],
                                                     "instance_group": [{"kind": "KIND_CPU", "count": 2}]})
    repository.write_config(root / "minilm_guard", {
        "name": "minilm_guard", "backend": "guard", **TEXT_IO, **batched(count=2, delay=0),
        "parameters": params(target="minilm_raw", placement="bls", serves_as="minilm",
                             target_per_version="minilm_raw_v{version}")})
    repository.write_config(root / "minilm", {"name": "minilm", "platform": "ensemble", "max_batch_size": 64, **TEXT_IO,
                                              "ensemble_scheduling": {"step": [
                                                  step("minilm_intake", {"TEXT": "TEXT"}, {"TEXT": "T"}),
                                                  step("minilm_guard", {"TEXT": "T"}, {"EMBEDDING": "EMBEDDING"})]}})
    return root


def pt(tput, p99, *, id=0, knobs=None, concurrencies=(8, 16)):
    t = tput if isinstance(tput, tuple) else (tput,) * len(concurrencies)
    q = p99 if isinstance(p99, tuple) else (p99,) * len(concurrencies)
    return Point(id=id, knobs=knobs or {}, status="ok",
                 stats={c: Stat(a, b / 2, b) for c, a, b in zip(concurrencies, t, q, strict=True)})


# -- discovering the pipeline ---------------------------------------------------------------------
def test_discover_inprocess_digits(tmp_path):
    pipe, configs = tune.discover(digits_repo(tmp_path), "digits")
    assert (pipe.guard, pipe.target, pipe.placement, pipe.batcher) == ("digits", "digits_raw", "inprocess", "digits")
    assert pipe.load_order == ("digits_raw", "digits") and pipe.ensembles == () and not pipe.text
    assert set(configs) == {"digits", "digits_raw"}


def test_discover_bls_minilm_loads_leaves_first_and_every_pinned_ensemble(tmp_path):
    pipe, configs = tune.discover(minilm_repo(tmp_path), "minilm")
    assert (pipe.guard, pipe.target, pipe.placement, pipe.batcher) == ("minilm_guard", "minilm_encoder", "bls", "minilm_encoder")
    order = list(pipe.load_order)
    assert order[:2] == ["minilm_tokenizer", "minilm_encoder"]
    assert order.index("minilm_intake") < order.index("minilm_guard") < order.index("minilm_raw") < order.index("minilm")
    assert {"minilm_raw_v1", "minilm_raw_v2"} <= set(pipe.ensembles) and pipe.ensembles[-1] == "minilm"
    assert pipe.text and pipe.managed == ("minilm_encoder", "minilm_guard")


def test_discover_bad_input_is_one_line(tmp_path):
    digits_repo(tmp_path)
    with pytest.raises(TuneError, match="unknown model 'nope'.*digits"):
        tune.discover(tmp_path, "nope")
    with pytest.raises(TuneError, match="not a guarded model"):
        tune.discover(tmp_path, "digits_raw")


# -- search space and pruning ---------------------------------------------------------------------
def test_space_inprocess_prunes_the_targets_batcher(tmp_path):
    pipe, configs = tune.discover(digits_repo(tmp_path), "digits")
    space = tune.build_space(pipe, configs, cpus=2)
    assert TARGET_INSTANCES in space.pruned and TARGET_DELAY in space.pruned
    assert set(space.ladders) == {GUARD_INSTANCES, GUARD_DELAY, TARGET_THREADS, PREFERRED}
    assert space.ladders[GUARD_INSTANCES] == [1, 2] and space.ladders[TARGET_THREADS] == [1, 2]
    # in process every guard instance runs the artifact with the target's threads
    base = tune.read_knobs(pipe, configs)
    assert space.invalid({**base, GUARD_INSTANCES: 3, TARGET_THREADS: 2}) is not None
    assert space.invalid({**base, GUARD_INSTANCES: 2, TARGET_THREADS: 2}) is None


def test_space_bls_bounds_threads_times_instances_and_preferred_sizes(tmp_path):
    pipe, configs = tune.discover(minilm_repo(tmp_path), "minilm")
    space = tune.build_space(pipe, configs, cpus=2, max_instances=4)
    assert set(space.ladders) == {GUARD_INSTANCES, GUARD_DELAY, TARGET_INSTANCES, TARGET_DELAY, TARGET_THREADS, PREFERRED}
    base = tune.read_knobs(pipe, configs)
    assert base[TARGET_THREADS] == 2 and base[GUARD_INSTANCES] == 2 and base[GUARD_DELAY] == 0
    assert "target 4 instances x 2 threads" in space.invalid({**base, TARGET_INSTANCES: 4})
    assert space.invalid({**base, TARGET_INSTANCES: 2}) is None
    assert space.invalid({**base, PREFERRED: (128,)}) is not None
    assert all(max(p, default=0) <= 64 for p in space.ladders[PREFERRED])


def test_space_keeps_the_current_value_as_a_rung_and_filters_knobs(tmp_path):
    digits_repo(tmp_path, guard_extra={"dynamic_batching": {"max_queue_delay_microseconds": 300}})
    pipe, configs = tune.discover(tmp_path, "digits")
    space = tune.build_space(pipe, configs, cpus=2, only=(GUARD_DELAY,))
    assert list(space.ladders) == [GUARD_DELAY] and space.ladders[GUARD_DELAY] == [0, 100, 300, 500, 1000, 2000, 5000]
    assert space.pruned[GUARD_INSTANCES] == "not in --knobs"


def test_conflicting_settings_are_not_tuned(tmp_path):
    digits_repo(tmp_path, guard_extra={
        "instance_group": [{"kind": "KIND_CPU", "count": 1}, {"kind": "KIND_CPU", "count": 1}],
        "parameters": params(target="digits_raw", placement="inprocess", **{"runtime.intra_op_threads": 2})})
    pipe, configs = tune.discover(tmp_path, "digits")
    space = tune.build_space(pipe, configs, cpus=2)
    assert "2 instance_group entries" in space.pruned[GUARD_INSTANCES]
    assert "runtime.intra_op_threads" in space.pruned[TARGET_THREADS]


def test_no_dynamic_batching_is_never_added():
    intake = {"name": "minilm_intake", "backend": "intake", "max_batch_size": 64,
              "instance_group": [{"kind": "KIND_CPU", "count": 2}]}
    new = with_knobs(intake, {"delay_us": 500, "preferred": (8,), "instances": 3})
    assert "dynamic_batching" not in new and new["instance_group"][0]["count"] == 3
    assert conflicts(intake, (GUARD_DELAY,), "guard") == ["no dynamic_batching (tune never adds one)"]


def test_configs_for_changes_only_the_knobs_and_puts_preferred_on_the_batcher(tmp_path):
    pipe, configs = tune.discover(minilm_repo(tmp_path), "minilm")
    base = tune.read_knobs(pipe, configs)
    point = {**base, TARGET_DELAY: 1000, PREFERRED: (8,), GUARD_INSTANCES: 3}
    new = tune.configs_for(pipe, configs, point)
    assert set(new) == {"minilm_encoder", "minilm_guard"}
    enc, guard = new["minilm_encoder"], new["minilm_guard"]
    assert enc["dynamic_batching"] == {"max_queue_delay_microseconds": "1000", "preferred_batch_size": [8]}
    assert guard["instance_group"][0]["count"] == 3 and "preferred_batch_size" not in guard["dynamic_batching"]
    assert guard["parameters"] == configs["minilm_guard"]["parameters"]  # serves_as, target… kept
    assert tune.configs_for(pipe, configs, base) == {n: configs[n] for n in pipe.managed}
    repository.render_config(enc)  # valid for Triton's schema


# -- objective ------------------------------------------------------------------------------------
def test_throughput_objective_respects_p99_at_every_concurrency():
    obj = Objective("throughput", p99_ms=50, min_gain_pct=3)
    fast_but_slow_tail = pt((900, 1000), (30, 60))
    ok = pt((500, 600), (20, 40))
    assert not obj.feasible(fast_but_slow_tail) and obj.feasible(ok)
    assert obj.better(ok, fast_but_slow_tail) and not obj.better(fast_but_slow_tail, ok)
    assert not obj.better(pt(560, 40), pt(550, 40))  # +1.8 %: within noise
    assert obj.better(pt(570, 40), pt(550, 40))
    # two points over budget: the lower tail is the way back
    assert obj.better(pt(100, 55), pt(900, 80)) and not obj.better(pt(100, 79), pt(900, 80))
    assert not obj.better(Point(id=1, knobs={}, status="failed", error="load failed"), ok)


def test_latency_objective_keeps_a_throughput_floor():
    obj = Objective("latency", min_throughput_pct=90, min_gain_pct=0)
    best, close, slow = pt(1000, 20), pt(920, 10), pt(500, 5)
    pts = [best, close, slow]
    assert obj.feasible(close, pts) and not obj.feasible(slow, pts)
    assert obj.better(close, best, pts) and not obj.better(slow, best, pts)
    assert obj.choose(pts, close) is close
    simply = Objective("latency", min_throughput_pct=0)
    assert simply.choose(pts, slow) is slow


def test_choose_falls_back_to_the_best_feasible_or_none():
    obj = Objective("throughput", p99_ms=50)
    over, a, b = pt(900, 80, id=0), pt(400, 40, id=1), pt(600, 45, id=2)
    assert obj.choose([over, a, b], over) is b
    assert obj.choose([over], over) is None


@pytest.mark.parametrize("bad", [dict(kind="fast"), dict(p99_ms=0), dict(min_throughput_pct=150), dict(min_gain_pct=-101)])
def test_objective_rejects_bad_settings(bad):
    with pytest.raises(TuneError):
        Objective(**bad)


# -- coordinate descent ---------------------------------------------------------------------------
def drive(space, start, objective, landscape, budget=100):
    search = CoordinateDescent(space, start, objective)
    search.record(Point(id=0, knobs=dict(start), status="ok", stats={8: landscape(start)}))
    measured = [start]
    for cand in search.proposals():
        if len(measured) >= budget:
            break
        measured.append(cand)
        p = Point(id=len(measured), knobs=cand, status="ok", stats={8: landscape(cand)})
        if landscape(cand) is None:
            p.status, p.stats = "failed", {}
        search.record(p)
    return search, measured


def test_descent_finds_the_peak_one_knob_at_a_time_without_repeats(tmp_path):
    pipe, configs = tune.discover(minilm_repo(tmp_path), "minilm")
    space = tune.build_space(pipe, configs, cpus=4, max_instances=4, max_threads=4)
    start = tune.read_knobs(pipe, configs)

    def landscape(k):  # a peak at 3 guard instances and 1000 µs target delay; more threads cost p99
        tput = 1000 - 100 * abs(k[GUARD_INSTANCES] - 3) - 0.1 * abs(k[TARGET_DELAY] - 1000)
        return Stat(tput, 1.0, 10.0 * k[TARGET_THREADS])

    search, measured = drive(space, start, Objective("throughput", p99_ms=25), landscape)
    assert search.incumbent.knobs[GUARD_INSTANCES] == 3 and search.incumbent.knobs[TARGET_DELAY] == 1000
    assert search.incumbent.knobs[TARGET_THREADS] <= 2  # 3 threads: p99 30 > 25
    keys = [point_key(k) for k in measured]
    assert len(keys) == len(set(keys))
    # never more than one knob away from a point measured before it
    for i, k in enumerate(measured[1:], 1):
        assert min(sum(a != b for a, b in zip(point_key(k), prev, strict=True)) for prev in keys[:i]) == 1
    assert all(space.invalid(k) is None for k in measured)
    # on one core, 2 encoder instances x 2 threads oversubscribe it: pruned, not measured
    small = tune.build_space(pipe, configs, cpus=1, max_instances=4, max_threads=4)
    search, measured = drive(small, start, Objective("throughput", p99_ms=25), landscape)
    assert any(k[TARGET_INSTANCES] == 2 for k, _ in search.skipped)
    assert all(small.invalid(k) is None for k in measured)


def test_descent_stops_on_budget_and_survives_failed_points(tmp_path):
    pipe, configs = tune.discover(digits_repo(tmp_path), "digits")
    space = tune.build_space(pipe, configs, cpus=2)
    start = tune.read_knobs(pipe, configs)

    def landscape(k):
        return None if k[GUARD_INSTANCES] == 2 else Stat(100 + k[GUARD_DELAY] / 100, 1, 1)

    search, measured = drive(space, start, Objective(), landscape, budget=4)
    assert len(measured) == 4
    assert search.incumbent.knobs[GUARD_INSTANCES] == 1  # the failed point was not kept
    _, all_points = drive(space, start, Objective(), landscape)
    assert len(all_points) < len(list(itertools.product(*space.ladders.values())))  # not a grid


# -- --apply --------------------------------------------------------------------------------------
def _texts(repo, pipe):
    return {n: (repo / n / "config.pbtxt").read_text() for n in pipe.managed}


def test_apply_writes_a_backup_and_only_the_managed_knobs(tmp_path):
    repo = digits_repo(tmp_path)
    pipe, configs = tune.discover(repo, "digits")
    base = tune.read_knobs(pipe, configs)
    texts = _texts(repo, pipe)
    chosen = {**base, GUARD_INSTANCES: 2, TARGET_THREADS: 2, PREFERRED: (8,)}
    res = {a.model: a for a in apply_configs(repo, pipe, texts, base, chosen, "STAMP")}
    assert res["digits"].status == res["digits_raw"].status == "written"
    guard, target = repository.read_config(repo / "digits"), repository.read_config(repo / "digits_raw")
    assert guard["instance_group"][0]["count"] == 2 and guard["dynamic_batching"]["preferred_batch_size"] == [8]
    assert guard["parameters"] == configs["digits"]["parameters"]
    assert target["parameters"]["intra_op_threads"]["string_value"] == "2"
    assert {k: v for k, v in target.items() if k != "parameters"} == {k: v for k, v in configs["digits_raw"].items() if k != "parameters"}
    assert (repo / "digits" / "config.pbtxt.bak-STAMP").read_text() == texts["digits"]
    assert (repo / "digits_raw" / "config.pbtxt.bak-STAMP").read_text() == texts["digits_raw"]
    assert not list(repo.glob("*/.config.pbtxt.*"))  # no temp file left


def test_apply_leaves_a_hand_edited_or_conflicting_file_alone(tmp_path):
    repo = digits_repo(tmp_path)
    pipe, configs = tune.discover(repo, "digits")
    base = tune.read_knobs(pipe, configs)
    texts = _texts(repo, pipe)
    edited = texts["digits_raw"].replace("max_queue_delay_microseconds: 500", "max_queue_delay_microseconds: 400")
    (repo / "digits_raw" / "config.pbtxt").write_text(edited)
    chosen = {**base, TARGET_THREADS: 2}
    (res,) = [a for a in apply_configs(repo, pipe, texts, base, chosen, "S") if a.model == "digits_raw"]
    assert res.status == "skipped" and "changed since tune read it" in res.detail
    assert (repo / "digits_raw" / "config.pbtxt").read_text() == edited
    assert not (repo / "digits_raw" / "config.pbtxt.bak-S").exists()
    # a setting tune does not manage that conflicts with the change: reported, not overwritten
    repo2 = digits_repo(tmp_path / "two", guard_extra={"sequence_batching": {}, "dynamic_batching": None})
    pipe2, configs2 = tune.discover(repo2, "digits")
    texts2 = _texts(repo2, pipe2)
    (res2,) = [a for a in apply_configs(repo2, pipe2, texts2, base, {**base, GUARD_DELAY: 100}, "S")
               if a.model == "digits"]
    assert res2.status == "skipped" and "sequence_batching" in res2.detail
    assert (repo2 / "digits" / "config.pbtxt").read_text() == texts2["digits"]


# -- the command on bad input: one line, exit 2, no server --------------------------------------
def _app():
    app = typer.Typer()
    app.command("tune")(tune_command)
    app.callback()(lambda: None)
    return app


@pytest.mark.parametrize("args, message", [
    (["nope"], "unknown model 'nope'"),
    (["digits_raw"], "not a guarded model"),
    (["digits", "--knobs", "guard.colour"], "unknown knob"),
    (["digits", "--objective", "latency", "--min-throughput-pct", "120"], "min-throughput-pct"),
    (["digits", "--concurrency", "8,x"], "--concurrency"),
])
def test_cli_bad_input(tmp_path, args, message):
    repo = digits_repo(tmp_path / "repo")
    res = CliRunner().invoke(_app(), ["tune", *args, "-r", str(repo), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert not (tmp_path / "out").exists()


# -- the run loop, with a fake server -------------------------------------------------------------
class FakeSession:
    """Stands in for the private server: records loads; a load of a point with 2 guard
    instances fails (as Triton refuses a config), and with ``dead`` every load after it too."""

    dead_after_failure = False
    instances: list = []

    def __init__(self, repo, pipe, configs, workdir, log_path):
        self.pipe, self.loads, self.failed = pipe, [], False
        self.loaded = {n: configs[n] for n in pipe.managed}
        self.url = "127.0.0.1:1"
        FakeSession.instances.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stopped = True

    def start(self):
        pass

    def load(self, new, *, force=False):
        if self.failed and self.dead_after_failure:
            raise TuneError("load of digits failed: connection refused")
        self.loads.append((new[self.pipe.guard]["instance_group"][0]["count"], force))
        if new[self.pipe.guard]["instance_group"][0]["count"] == 2:
            self.failed = True
            raise TuneError("load of digits failed: bad config")
        return []


def _fake_measure(url, model, c, data, **kw):
    return Stat(100.0 * c, 1.0, 2.0)


def test_run_reports_a_failed_point_restores_and_goes_on(tmp_path, monkeypatch):
    repo = digits_repo(tmp_path / "repo")
    monkeypatch.setattr(tune, "Session", FakeSession)
    FakeSession.instances, FakeSession.dead_after_failure = [], False
    events = []
    settings = tune.Settings(concurrency=(2,), budget_points=3, knobs=(GUARD_INSTANCES, GUARD_DELAY), confirm=False)
    result, texts = tune.run(repo, "digits", settings, tmp_path, tmp_path / "log",
                             progress=lambda e, d: events.append(e), measure=_fake_measure)
    (session,) = FakeSession.instances
    assert session.stopped
    failed = [p for p in result.points if p.status == "failed"]
    assert len(failed) == 1 and failed[0].knobs[GUARD_INSTANCES] == 2 and "bad config" in failed[0].error
    assert (1, True) in session.loads  # the incumbent's configs loaded again, forced
    assert len(result.points) == 3 and not result.aborted and result.stop_reason == "budget: 3 points"
    assert result.chosen is result.baseline  # equal figures: nothing beats the current config
    assert texts == _texts(repo, result.pipe)
    rep = tune.report(result)
    assert rep["points"][1]["status"] == "failed" and rep["chosen"]["baseline"] is True
    assert "measured" in events and "space" in events


def test_run_stops_with_what_it_has_when_the_server_is_gone(tmp_path, monkeypatch):
    repo = digits_repo(tmp_path / "repo")
    monkeypatch.setattr(tune, "Session", FakeSession)
    FakeSession.instances, FakeSession.dead_after_failure = [], True
    settings = tune.Settings(concurrency=(2,), budget_points=6, knobs=(GUARD_INSTANCES, GUARD_DELAY))
    result, _ = tune.run(repo, "digits", settings, tmp_path, tmp_path / "log", measure=_fake_measure)
    assert result.aborted and result.stop_reason.startswith("stopped: cannot restore the incumbent")
    assert [p.status for p in result.points] == ["ok", "failed"] and result.confirm == {}
    assert tune.report(result)["aborted"] is True


class DelaySession(FakeSession):
    """A server where the guard's queue delay fills batches at c=16 and makes a lone request wait."""

    def load(self, new, *, force=False):
        self.delay = int(new[self.pipe.guard].get("dynamic_batching", {}).get("max_queue_delay_microseconds", 0))
        return []


def test_the_confirmation_reports_what_the_chosen_layout_does_to_a_lone_request(tmp_path, monkeypatch):
    """The objective weighs the tuned concurrencies only; a layout that wins at c=16 can lose a
    lone request (issue 33: minilm's 2 guard instances, 1.75x at c=16, 0.81x at c=1). The
    confirmation measures c=1 too and the summary says so."""
    repo = digits_repo(tmp_path / "repo")
    monkeypatch.setattr(tune, "Session", DelaySession)
    FakeSession.instances = []
    seen = []

    def measure(url, model, c, data, **kw):
        delay_ms = FakeSession.instances[-1].delay / 1000
        seen.append(c)
        if c == 1:
            return Stat(1000 / (1 + delay_ms), 1 + delay_ms, 2 + delay_ms)
        return Stat(100 * (1 + delay_ms), 5.0, 9.0)

    settings = tune.Settings(concurrency=(16,), budget_points=4, knobs=(GUARD_DELAY,))
    result, _ = tune.run(repo, "digits", settings, tmp_path, tmp_path / "log", measure=measure)
    assert result.chosen is not None and result.chosen.knobs[GUARD_DELAY] > result.base[GUARD_DELAY]
    assert result.confirmed is True
    assert seen.count(1) == 2  # baseline and chosen, in the confirmation only
    assert all(p.lone is None for p in result.points if p.phase != "confirm")
    lone = tune.report(result)["lone_request"]
    assert lone["throughput_change_pct"] < -5 and lone["p50_change_ms"] > 0
    line = next(x for x in _summary(result) if "one request at a time" in x)
    assert "slower for a lone request" in line and "[yellow]" in line
    # tuned at c=1 itself: no separate lone-request measurement
    FakeSession.instances, seen[:] = [], []
    settings = tune.Settings(concurrency=(1, 16), budget_points=4, knobs=(GUARD_DELAY,))
    result, _ = tune.run(repo, "digits", settings, tmp_path, tmp_path / "log2", measure=measure)
    assert result.lone_request is None and tune.report(result)["lone_request"] is None


def test_a_lone_request_that_cannot_be_measured_is_reported_not_held_against_the_point(tmp_path, monkeypatch):
    repo = digits_repo(tmp_path / "repo")
    monkeypatch.setattr(tune, "Session", DelaySession)
    FakeSession.instances = []

    def measure(url, model, c, data, **kw):
        if c == 1:
            raise TuneError("perf_analyzer failed at c=1: no stable measurement")
        return Stat(100 * (1 + FakeSession.instances[-1].delay / 1000), 5.0, 9.0)

    settings = tune.Settings(concurrency=(16,), budget_points=4, knobs=(GUARD_DELAY,))
    result, _ = tune.run(repo, "digits", settings, tmp_path, tmp_path / "log", measure=measure)
    assert result.confirmed is True and all(p.ok for p in result.confirm.values())
    assert result.lone_request == {"error": "perf_analyzer failed at c=1: no stable measurement"}
    line = next(x for x in _summary(result) if "one request at a time" in x)
    assert "not measured" in line and "no stable measurement" in line
