"""The suite's lanes (tests/lanes.py, issue 40): every module runs exactly once, timed modules
never in two lanes, and two lanes never hand out the same loopback port."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import lanes
from tests.conftest import REDIS_SERVER
from tritonguard.ops.server import free_port

ROOT = Path(__file__).resolve().parents[2]


# a process started under SCHED_IDLE by chrt(1) (util-linux), not by ``preexec_fn=lanes._idle``:
# this test runs in a lane process that earlier modules may have given a live gRPC channel, and a
# preexec_fn runs gRPC's at-fork hook in the child, which can abort it (8 of 300 starts;
# tritonguard/ops/supervisor/control.py, run 41). The lanes runner itself never loads gRPC.
IDLE = ["chrt", "--idle", "0"]


TAG = f"{sys.implementation.cache_tag}-pytest-{pytest.__version__}"  # pytest's cached test modules


def test_every_module_runs_once_and_the_timed_ones_after_the_lanes():
    mods = lanes.modules(["tests"])
    assert "tests/unit/test_lanes.py" in mods and "tests/functional/test_promote.py" in mods
    plan, tail, timed = lanes.split(mods, 2, lanes.TAIL_SHARE)
    assert sorted([m for lane in plan for m in lane] + tail + timed) == mods
    # the shared tail: the lightest unit modules, within its share of the dealt work, heaviest first
    dealt = sum(lanes.weight(m) for lane in plan for m in lane) + sum(lanes.weight(m) for m in tail)
    assert tail and all(m.startswith("tests/unit/") for m in tail)
    assert sum(lanes.weight(m) for m in tail) <= lanes.TAIL_SHARE * dealt
    assert max(lanes.weight(m) for m in tail) <= min(lanes.weight(m) for lane in plan[:2] for m in lane
                                                    if m.startswith("tests/unit/"))
    assert [lanes.weight(m) for m in tail] == sorted((lanes.weight(m) for m in tail), reverse=True)
    assert sorted(timed) == sorted(lanes.TIMED) and not {m for lane in plan for m in lane} & set(lanes.TIMED)
    # the lanes are balanced by the recorded times: neither holds more than 60 % of their work
    loads = [sum(lanes.weight(m) for m in lane) for lane in plan]
    assert max(loads) < 0.6 * sum(loads), loads
    for m in lanes.TIMED + lanes.RELATIVE + lanes.WAITING:  # a renamed module must not silently fall out of a list
        assert (ROOT / m).is_file(), m
    assert set(lanes.ALONE) <= set(lanes.TIMED)  # timed modules, run after the lanes instead of beside them
    # the modules that mostly wait share one extra lane, and only they are in it
    assert len(plan) == 3 and sorted(plan[-1]) == sorted(lanes.WAITING)
    for group in lanes.TOGETHER:  # two local Ray clusters never at once
        assert sum(1 for lane in plan if set(group) & set(lane)) == 1, group
        for m in group:
            assert (ROOT / m).is_file(), m
    one, no_tail, _ = lanes.split(mods, 1, lanes.TAIL_SHARE)
    assert no_tail == []
    assert len(one) == 1 and sorted(one[0]) == sorted(m for m in mods if m not in lanes.TIMED)
    # the rollout modules with relative gates run in the lanes, not in the timed phase
    assert set(lanes.RELATIVE) <= {m for lane in plan for m in lane} and not set(lanes.RELATIVE) & set(lanes.TIMED)


def test_paths_and_options_are_told_apart():
    mods = lanes.modules(["tests/unit/test_lanes.py", "tests/functional"])
    assert mods[-1] == "tests/unit/test_lanes.py" and all(m.startswith("tests/") for m in mods)


def test_two_lanes_never_pick_the_same_port():
    code = ("from tritonguard.ops.server import free_port; "
            "print(' '.join(str(free_port()) for _ in range(200)))")
    picked = []
    for lane in ("0/2", "1/2"):
        env = {**os.environ, "TRITONGUARD_PORT_LANE": lane}
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
        picked.append({int(p) for p in out})
        assert len(picked[-1]) == 200
    assert not picked[0] & picked[1]
    assert all((p >> 1) % 2 == 0 for p in picked[0]) and all((p >> 1) % 2 == 1 for p in picked[1])
    bad = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITONGUARD_PORT_LANE": "2/2"},
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "TRITONGUARD_PORT_LANE='2/2'" in bad.stderr


def test_a_run_in_lanes_names_its_folders_without_spaces(tmp_path, monkeypatch):
    """The lanes' names go into the paths their servers use (basetemp, TRITONGUARD_HOME): "lane 0"
    put a space in every model repository path, and no tritonserver of the run loaded a Python
    model (CI clone, 2026-11-28). Two tiny modules run through main() in two lanes and a timed one."""
    (tmp_path / "test_a.py").write_text("import os\ndef test_a():\n    assert ' ' not in os.environ['TRITONGUARD_HOME']\n")
    (tmp_path / "test_b.py").write_text("def test_b(tmp_path):\n    assert ' ' not in str(tmp_path)\n")
    (tmp_path / "test_c.py").write_text("def test_c(tmp_path):\n    assert ' ' not in str(tmp_path)\n")
    monkeypatch.setattr(lanes, "TIMED", (str(tmp_path / "test_c.py"),))
    monkeypatch.setattr(lanes, "modules", lambda paths: [str(tmp_path / n) for n in ("test_a.py", "test_b.py", "test_c.py")])
    monkeypatch.delenv("TRITONGUARD_HOME", raising=False)
    assert lanes.main([str(tmp_path), "-q"]) == 0


def test_a_green_run_removes_its_folder_and_a_red_one_keeps_and_names_it(tmp_path, monkeypatch, capsys):
    """Each run's folder (lane logs, basetemps with the servers' repositories) took up to 1.2 GB and
    was never removed: a day of full runs filled this machine's disk (2026-11-30)."""
    made: list[Path] = []
    real = lanes.tempfile.mkdtemp

    def mkdtemp(**kw):
        made.append(Path(real(**kw)))
        return str(made[-1])

    monkeypatch.setattr(lanes.tempfile, "mkdtemp", mkdtemp)
    (tmp_path / "test_a.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "test_b.py").write_text("import os\ndef test_b():\n    assert os.environ.get('FAIL_B') != '1'\n")
    monkeypatch.setattr(lanes, "TIMED", ())
    monkeypatch.setattr(lanes, "modules", lambda paths: [str(tmp_path / n) for n in ("test_a.py", "test_b.py")])
    monkeypatch.delenv("TRITONGUARD_HOME", raising=False)
    assert lanes.main([str(tmp_path), "-q"]) == 0
    assert len(made) == 1 and not made[0].exists()
    monkeypatch.setenv("FAIL_B", "1")
    capsys.readouterr()
    assert lanes.main([str(tmp_path), "-q"]) == 1
    assert len(made) == 2 and sorted(p.name for p in made[1].glob("*.log")) == ["lane0.log", "lane1.log"]
    out = capsys.readouterr().out
    assert f"the run's folder is kept for the failure (each lane's log, basetemp with the servers' logs " \
           f"and repositories, TRITONGUARD_HOME): {made[1]}" in out, out[-500:]
    shutil.rmtree(made[1])


def test_the_lanes_yield_the_cores_to_the_timed_modules_until_these_end(tmp_path, monkeypatch):
    """The timed modules run at once with the lanes: the lanes under SCHED_IDLE (so a p99 bound
    never waits for a lane's process), then, once the timed process has ended, back to the normal
    policy. Real processes, real scheduling policies: both lane modules record their policy while
    the timed one waits for both records (it once ended before the second lane's pytest had started,
    which then saw the normal policy: CI, stop 53); the second lane then waits for its own policy to
    come back."""
    (tmp_path / "test_a.py").write_text(
        "import os, pathlib\n"
        "def test_a():\n"
        f"    pathlib.Path({str(tmp_path / 'a.txt')!r}).write_text(str(os.sched_getscheduler(0)))\n")
    (tmp_path / "test_b.py").write_text(
        "import os, pathlib, time\n"
        "def test_b():\n"
        f"    pathlib.Path({str(tmp_path / 'b.txt')!r}).write_text(str(os.sched_getscheduler(0)))\n"
        "    deadline = time.monotonic() + 60\n"
        "    while os.sched_getscheduler(0) != os.SCHED_OTHER:\n"
        "        assert time.monotonic() < deadline, 'still SCHED_IDLE a minute on'\n"
        "        time.sleep(0.1)\n")
    (tmp_path / "test_c.py").write_text(
        "import os, pathlib, time\n"
        "def test_c():\n"
        "    assert os.sched_getscheduler(0) == os.SCHED_OTHER\n"
        f"    records = [pathlib.Path({str(tmp_path / 'a.txt')!r}), pathlib.Path({str(tmp_path / 'b.txt')!r})]\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not all(r.exists() and r.read_text() for r in records):\n"
        "        assert time.monotonic() < deadline\n"
        "        time.sleep(0.05)\n"
        "    assert [int(r.read_text()) for r in records] == [os.SCHED_IDLE, os.SCHED_IDLE]\n")
    monkeypatch.setattr(lanes, "TIMED", (str(tmp_path / "test_c.py"),))
    monkeypatch.setattr(lanes, "modules", lambda paths: [str(tmp_path / n) for n in ("test_a.py", "test_b.py", "test_c.py")])
    monkeypatch.delenv("TRITONGUARD_TIMED_AFTER", raising=False)
    assert lanes.main([str(tmp_path), "-q"]) == 0


def test_the_lanes_run_torch_on_one_thread_and_the_timed_modules_on_the_default(tmp_path, monkeypatch):
    """OMP_NUM_THREADS=1 for every process of a lane (lanes.LANE_THREADS), unless the caller set
    it; the timed process gets the caller's environment as it is."""
    for name in ("a", "b", "c"):
        (tmp_path / f"test_{name}.py").write_text(
            "import os, pathlib\n"
            f"def test_{name}():\n"
            f"    pathlib.Path({str(tmp_path / f'{name}.txt')!r}).write_text(os.environ.get('OMP_NUM_THREADS', '-'))\n")
    monkeypatch.setattr(lanes, "TIMED", (str(tmp_path / "test_c.py"),))
    monkeypatch.setattr(lanes, "modules", lambda paths: [str(tmp_path / n) for n in ("test_a.py", "test_b.py", "test_c.py")])
    monkeypatch.delenv("TRITONGUARD_TIMED_AFTER", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert lanes.main([str(tmp_path), "-q"]) == 0
    assert [(tmp_path / f"{n}.txt").read_text() for n in "abc"] == [lanes.LANE_THREADS, lanes.LANE_THREADS, "-"]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert lanes.main([str(tmp_path), "-q"]) == 0
    assert [(tmp_path / f"{n}.txt").read_text() for n in "abc"] == ["3", "3", "3"]


def test_back_to_normal_finds_a_lane_process_outside_its_tree(tmp_path):
    """A process that left the lane's tree (a new session, as Ray's and the supervisor's do) is
    found by the mark in its environment; one without the mark is left as it is."""
    def start(mark: str | None) -> subprocess.Popen:
        env = {**os.environ, **({lanes.LANE_MARK: mark} if mark else {})}
        p = subprocess.Popen([*IDLE, "sleep", "30"], env=env, start_new_session=True)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{p.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
            time.sleep(0.01)  # chrt has set the policy once it has exec'd sleep
        return p

    marked, other, unmarked = start(f"lane0@{tmp_path}"), start(f"lane0@{tmp_path}-other"), start(None)
    try:
        assert all(os.sched_getscheduler(p.pid) == os.SCHED_IDLE for p in (marked, other, unmarked))
        assert lanes.back_to_normal({f"lane0@{tmp_path}"}) == 1
        assert os.sched_getscheduler(marked.pid) == os.SCHED_OTHER
        assert os.sched_getscheduler(other.pid) == os.SCHED_IDLE and os.sched_getscheduler(unmarked.pid) == os.SCHED_IDLE
    finally:
        for p in (marked, other, unmarked):
            p.kill()
            p.wait()


def test_back_to_normal_finds_a_server_that_wrote_its_title_over_its_environment(tmp_path):
    """redis-server writes its title over its environment (/proc/PID/environ then holds no mark):
    found as the child of a marked process, so a Redis a lane started under SCHED_IDLE is back
    to the normal policy with the lane (run 19's fleet quota failure, tests/lanes.py:_marked)."""
    server = REDIS_SERVER
    if not server:
        pytest.skip("redis-server is not installed (/usr/bin/redis-server; apt-get install redis-server)")
    mark = f"lane0@{tmp_path}"
    code = ("import subprocess, sys, time\n"
            f"p = subprocess.Popen([{server!r}, '--port', sys.argv[1], '--bind', '127.0.0.1', '--save', '',"
            " '--appendonly', 'no'], stdout=subprocess.DEVNULL)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([*IDLE, sys.executable, "-c", code, str(free_port())],
                              env={**os.environ, lanes.LANE_MARK: mark}, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    redis_pid = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 10
        while lanes.LANE_MARK.encode() in Path(f"/proc/{redis_pid}/environ").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)  # until redis-server has written its title
        assert lanes.LANE_MARK.encode() not in Path(f"/proc/{redis_pid}/environ").read_bytes()
        assert os.sched_getscheduler(redis_pid) == os.SCHED_IDLE
        assert redis_pid in lanes.leftovers({mark})
        assert lanes.back_to_normal({mark}) >= 2  # the parent's thread and redis-server's
        threads = [int(t) for t in os.listdir(f"/proc/{redis_pid}/task")]
        assert threads and all(os.sched_getscheduler(t) == os.SCHED_OTHER for t in threads)
    finally:
        os.kill(redis_pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_an_alone_module_runs_after_the_lanes_and_the_timed_ones(tmp_path, monkeypatch):
    """An ALONE module (a tail compared across two windows) starts only once every lane and the
    timed process have ended, under the normal policy."""
    done = tmp_path / "done"
    done.mkdir()
    for name, pause in (("test_a.py", 1.0), ("test_c.py", 0.5)):
        (tmp_path / name).write_text(
            "import pathlib, time\n"
            f"def test_{name[5]}():\n"
            f"    time.sleep({pause})\n"
            f"    pathlib.Path({str(done / name)!r}).touch()\n")
    (tmp_path / "test_d.py").write_text(
        "import os, pathlib\n"
        "def test_d():\n"
        "    assert os.sched_getscheduler(0) == os.SCHED_OTHER\n"
        f"    assert sorted(p.name for p in pathlib.Path({str(done)!r}).iterdir()) == ['test_a.py', 'test_c.py']\n")
    monkeypatch.setattr(lanes, "TIMED", (str(tmp_path / "test_c.py"), str(tmp_path / "test_d.py")))
    monkeypatch.setattr(lanes, "ALONE", (str(tmp_path / "test_d.py"),))
    monkeypatch.setattr(lanes, "modules", lambda paths: [str(tmp_path / n) for n in ("test_a.py", "test_c.py", "test_d.py")])
    monkeypatch.delenv("TRITONGUARD_TIMED_AFTER", raising=False)
    assert lanes.main([str(tmp_path), "-q"]) == 0


def test_the_alone_phase_starts_once_the_lanes_leftovers_are_gone(tmp_path, monkeypatch, capsys):
    """A lane module that leaves a process behind (a server detached into its own session, as
    Ray's are) does not share the machine with the alone phase: the runner kills it by PID before
    that phase starts, and says which it was."""
    pid_file = tmp_path / "leftover.pid"
    (tmp_path / "test_a.py").write_text(
        "import pathlib, subprocess\n"
        "def test_a():\n"
        "    p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        f"    pathlib.Path({str(pid_file)!r}).write_text(str(p.pid))\n")
    (tmp_path / "test_c.py").write_text("def test_c():\n    pass\n")
    (tmp_path / "test_d.py").write_text(
        "import os, pathlib\n"
        "def test_d():\n"
        f"    pid = int(pathlib.Path({str(pid_file)!r}).read_text())\n"
        "    state = pathlib.Path(f'/proc/{pid}/stat').read_text().split()[2] if os.path.exists(f'/proc/{pid}') else 'gone'\n"
        "    assert state in ('gone', 'Z'), state\n")
    monkeypatch.setattr(lanes, "TIMED", (str(tmp_path / "test_c.py"), str(tmp_path / "test_d.py")))
    monkeypatch.setattr(lanes, "ALONE", (str(tmp_path / "test_d.py"),))
    monkeypatch.setattr(lanes, "QUIET_WAIT_S", 1.0)
    monkeypatch.setattr(lanes, "modules", lambda paths: [str(tmp_path / n) for n in ("test_a.py", "test_c.py", "test_d.py")])
    monkeypatch.delenv("TRITONGUARD_TIMED_AFTER", raising=False)
    try:
        assert lanes.main([str(tmp_path), "-q"]) == 0
        out = capsys.readouterr().out
        assert f"killed: pid {pid_file.read_text()}: sleep 300" in out, out
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), 9)
            except OSError:
                pass


def test_the_projects_bytecode_is_written_once_and_read_where_no_process_writes_any(tmp_path):
    """lanes.precompile: the packages' modules get their __pycache__ file, the tests' own modules
    pytest's (the code of its assert rewriting); a second call writes nothing, an edited module
    is compiled again; processes under PYTHONDONTWRITEBYTECODE=1 load the cached code instead of
    compiling the source: Python the package's, pytest the test module's, whose failing assert
    still says what pytest's rewriting says."""
    (tmp_path / "tritonguard").mkdir()
    (tmp_path / "tritonguard" / "mod.py").write_text("VALUE = 1\n")
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    for name in ("helper.py", "conftest.py"):
        (tmp_path / "tests" / name).write_text("X = 1\n")
    test_x = tmp_path / "tests" / "unit" / "test_x.py"
    test_x.write_text("def test_x():\n    a, b = 1, 2\n    assert a == b\n")
    more = [f"test_m{i}" for i in range(16)]  # enough to be rewritten by a pool of processes
    for name in more:
        (tmp_path / "tests" / "unit" / f"{name}.py").write_text(f"def {name}():\n    assert {name}\n")
    assert lanes.precompile(tmp_path) == 2 + 2 + len(more)
    cached = {p.relative_to(tmp_path).parts[0] + "/" + p.name.split(".")[0] for p in tmp_path.rglob("*.pyc")}
    assert cached == {"tritonguard/mod", "tests/helper", "tests/conftest", "tests/test_x",
                      *(f"tests/{name}" for name in more)}
    rewritten = sorted(p.name for p in tmp_path.rglob("*-pytest-*.pyc"))
    assert rewritten == sorted(f"{name}.{TAG}.pyc" for name in ("conftest", "test_x", *more)), rewritten
    assert lanes.precompile(tmp_path) == 0
    mod = tmp_path / "tritonguard" / "mod.py"
    mod.write_text("VALUE = 22\n")
    os.utime(mod, (time.time() + 2, time.time() + 2))  # compileall compares whole seconds of mtime
    test_x.write_text("def test_x():\n    a, b = 1, 3\n    assert a == b\n")
    assert lanes.precompile(tmp_path) == 2
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tmp_path)}
    env.pop("PYTHONPYCACHEPREFIX", None)
    res = subprocess.run([sys.executable, "-v", "-c", "import tritonguard.mod as m; print(m.VALUE)"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=True)
    assert res.stdout == "22\n"
    assert f"code object from '{tmp_path / 'tritonguard' / '__pycache__'}" in res.stderr, res.stderr[-2000:]
    # pytest's trace names the cached file it read; the assert's message is the rewritten one
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--debug=trace.log",
                          "--rootdir", str(tmp_path), "tests/unit/test_x.py"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert res.returncode == 1 and "assert 1 == 3" in res.stdout, res.stdout[-2000:]
    trace = (tmp_path / "trace.log").read_text()
    assert f"found cached rewritten pyc for {test_x}" in trace, trace[-3000:]
    assert f"rewriting {str(test_x)!r}" not in trace


def test_the_lane_that_is_free_takes_the_shared_tail_and_each_tail_module_runs_once(tmp_path, monkeypatch):
    """tests.tail: both lanes collect the tail, each tail module runs in the lane that claims it
    first, all its tests there. Real processes: lane 0's own module waits until the tail has run
    (a minute at most), so only lane 1 can take it; each tail test records the lane that ran it."""
    record = (
        "import os, pathlib\n"
        "def _record(name):\n"
        f"    with open({str(tmp_path / 'ran.txt')!r}, 'a') as f:\n"
        "        f.write(name + ' ' + os.environ['TRITONGUARD_LANE'].split('@')[0] + '\\n')\n")
    (tmp_path / "test_a.py").write_text(
        record + "import time\n"
        "def test_a():\n"
        f"    ran = pathlib.Path({str(tmp_path / 'ran.txt')!r})\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not ran.exists() or len(ran.read_text().splitlines()) < 6:  # b's test and the tail's five\n"
        "        assert time.monotonic() < deadline, 'the tail did not run beside this module'\n"
        "        time.sleep(0.05)\n"
        "    _record('a')\n")
    (tmp_path / "test_b.py").write_text(record + "def test_b():\n    _record('b')\n")
    for k in range(1, 5):
        tests = "".join(f"def test_t{k}_{j}():\n    _record('t{k}_{j}')\n" for j in range(2 if k == 1 else 1))
        (tmp_path / f"test_t{k}.py").write_text(record + tests)
    names = ["test_a.py", "test_b.py", *(f"test_t{k}.py" for k in range(1, 5))]
    monkeypatch.setattr(lanes, "TIMED", ())
    monkeypatch.setattr(lanes, "WAITING", ())
    monkeypatch.setattr(lanes, "TAIL_PREFIX", str(tmp_path / "test_t"))
    monkeypatch.setattr(lanes, "TAIL_SHARE", 0.3)
    monkeypatch.setattr(lanes, "weight", lambda m: 10.0 if m.endswith(("test_a.py", "test_b.py")) else 1.0)
    monkeypatch.setattr(lanes, "modules", lambda paths: [str(tmp_path / n) for n in names])
    assert lanes.main([str(tmp_path), "-q"]) == 0
    ran = dict(line.split() for line in (tmp_path / "ran.txt").read_text().splitlines())
    tail = ["t1_0", "t1_1", "t2_0", "t3_0", "t4_0"]
    assert sorted(ran) == sorted(["a", "b", *tail]) and len((tmp_path / "ran.txt").read_text().splitlines()) == 7
    assert {ran["a"], ran["b"]} == {"lane0", "lane1"}
    assert {ran[t] for t in tail} == {ran["b"]}, ran  # the free lane took all of it, each test once


def test_a_tail_module_another_lane_claimed_meanwhile_is_passed_over_cleanly(tmp_path):
    """tests.tail tells pytest which test comes next before it claims that test's module (a lane
    holds no claim while its own module runs); when another lane claims that module in between,
    this lane tears down what the module it really runs next does not share (here a folder)
    and runs it. The other lane is this lane's own test, which claims the module as it runs."""
    folder = tmp_path / "tail"
    folder.mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    t1, t2 = tmp_path / "a" / "test_t1.py", tmp_path / "b" / "test_t2.py"
    (folder / "modules.txt").write_text(f"{t1}\n{t2}\n")
    own = tmp_path / "a" / "test_own.py"
    own.write_text(
        "import pytest\n"
        "@pytest.fixture(scope='module')\n"
        "def held():\n"
        "    yield 1\n"
        "def test_first(held):\n    pass\n"
        "def test_last(held):\n"
        "    from pathlib import Path\n"
        "    from tests.tail import claim\n"
        f"    assert claim(Path({str(folder)!r}), Path({str(t1)!r}))  # the other lane, after the peek\n")
    t1.write_text("def test_t1():\n    raise AssertionError('claimed by the other lane: never run here')\n")
    t2.write_text("def test_t2():\n    pass\n")
    res = subprocess.run([sys.executable, "-m", "pytest", str(own), str(t1), str(t2), "-p", "tests.tail", "-q",
                          "-p", "no:cacheprovider", "-rA"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRITONGUARD_TAIL": str(folder)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    passed = sorted(line.split("::")[-1] for line in res.stdout.splitlines() if line.startswith("PASSED"))
    assert passed == ["test_first", "test_last", "test_t2"], res.stdout[-3000:]
    assert (folder / f"{str(t2).strip('/').replace('/', '__')}.claim").read_text().strip() != ""
