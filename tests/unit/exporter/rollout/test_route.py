import json

import pytest
from typer.testing import CliRunner

from exporter.cli.app import app
from exporter.rollout.guards import NotAGuard
from exporter.rollout.route import RouteChange, RouteError, apply, parse_arms, show
from tritonguard.core.repository import write_config

GUARD = {"name": "m", "backend": "guard", "max_batch_size": 4,
         "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [2]}],
         "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [2]}],
         "parameters": {"target": {"string_value": "m_raw"}}}


@pytest.fixture
def repo(tmp_path):
    write_config(tmp_path / "m", GUARD)
    for v in (1, 2, 3):
        (tmp_path / "m_raw" / str(v)).mkdir(parents=True)
    return tmp_path


def test_route_sets_candidate_share_and_primary(repo):
    st = apply(repo, "m", RouteChange(primary=1))
    assert st.primary == 1 and st.candidate is None
    st = apply(repo, "m", RouteChange(candidate=2, share=0.1, shadow=0.2))
    assert st.candidate.version == 2 and st.candidate.share == 0.1 and st.shadow_share == 0.2
    st = apply(repo, "m", RouteChange(share=0.5))
    assert st.candidate.share == 0.5
    st = apply(repo, "m", RouteChange(primary=2))  # promoting the candidate clears it
    assert st.primary == 2 and st.previous_primary == 1 and st.candidate is None
    assert show(repo, "m")["primary"] == {"version": 2}


@pytest.mark.parametrize("change,msg", [
    (RouteChange(candidate=9), "v9 is not a version of 'm_raw'"),
    (RouteChange(candidate=2, share=1.5), "share must be in"),
    (RouteChange(share=0.3), "needs a candidate"),
])
def test_route_rejects_bad_changes(repo, change, msg):
    with pytest.raises(RouteError, match=msg):
        apply(repo, "m", change)


def test_route_refuses_non_guard(repo):
    with pytest.raises(NotAGuard, match="no model 'nope'"):
        apply(repo, "nope", RouteChange(primary=1))


def test_route_cli(repo):
    runner = CliRunner()
    res = runner.invoke(app, ["route", "m", "-r", str(repo), "--primary", "1", "--candidate", "3",
                              "--share", "0.05", "--json"])
    assert res.exit_code == 0, res.output
    state = json.loads(res.stdout)
    assert state["candidate"] == {"version": 3, "share": 0.05}
    res = runner.invoke(app, ["route", "m", "-r", str(repo), "--candidate", "7"])
    assert res.exit_code == 2 and "not a version" in res.output


def test_abn_arms_set_show_and_end(repo):
    apply(repo, "m", RouteChange(primary=1))
    st = apply(repo, "m", RouteChange(arms=parse_arms("2=0.3, 3=0.2")))
    assert [(a.version, a.weight) for a in st.arms] == [(2, 0.3), (3, 0.2)]
    res = CliRunner().invoke(app, ["route", "m", "-r", str(repo)])
    assert res.exit_code == 0 and "A/B/n: v2 30%, v3 20%, primary v1 50%" in res.output, res.output
    # a candidate cannot join the split; promoting an arm to primary takes it out of the split
    with pytest.raises(RouteError, match="--arms none"):
        apply(repo, "m", RouteChange(candidate=2, share=0.1))
    st = apply(repo, "m", RouteChange(primary=3))
    assert st.primary == 3 and [(a.version, a.weight) for a in st.arms] == [(2, 0.3)]
    st = apply(repo, "m", RouteChange(arms=parse_arms("none")))
    assert st.arms == []
    st = apply(repo, "m", RouteChange(candidate=2, share=0.1))
    assert st.candidate.version == 2
    with pytest.raises(RouteError, match="candidate v2 in rollout"):
        apply(repo, "m", RouteChange(arms=[(1, 0.2)]))


@pytest.mark.parametrize("text, message", [
    ("2", "not VERSION=WEIGHT"), ("2=x", "not VERSION=WEIGHT"), ("v2=0.1", "not VERSION=WEIGHT"),
])
def test_abn_arms_parse_errors(text, message):
    with pytest.raises(RouteError, match=message):
        parse_arms(text)


@pytest.mark.parametrize("arms, message", [
    ([(9, 0.1)], "arm v9 is not a version"),
    ([(2, 0.0)], "weight must be in \\(0, 1\\]"),
    ([(1, 0.2)], "v1 is the primary"),
    ([(2, 0.7), (3, 0.5)], "sum to 1.2 > 1"),
])
def test_abn_bad_arms_are_refused_and_nothing_is_written(repo, arms, message):
    apply(repo, "m", RouteChange(primary=1))
    with pytest.raises(RouteError, match=message):
        apply(repo, "m", RouteChange(arms=arms))
    assert show(repo, "m")["arms"] == []


def test_abn_cli_errors_are_clear(repo):
    res = CliRunner().invoke(app, ["route", "m", "-r", str(repo), "--primary", "1", "--arms", "2:0.3"])
    assert res.exit_code == 2 and "not VERSION=WEIGHT" in res.output and "Traceback" not in res.output, res.output


def test_status_shows_the_split_and_errors_per_version():
    from rich.console import Console

    from exporter.cli.status import print_live

    st = {"revision": 4, "primary": {"version": 1}, "candidate": None, "shadow_share": 0.0,
          "fallback": ["candidate", "primary"], "breakers": {"3": {"state": "open", "trips": 1}},
          "arms": [{"version": 2, "weight": 0.25}, {"version": 3, "weight": 0.25}]}
    met = {"replicas": 2, "served": {"m_raw:1": 50, "m_raw:2": 25}, "breaker": {"3": 2}, "drift": {},
           "errors": {"3": 7}, "unreachable": []}
    console = Console(record=True, width=200)
    print_live(console, [{"model": "m", "target": "m_raw", "state": st, "stages": None, "rollout": None,
                          "metrics": met}])
    text = console.export_text()
    assert "A/B/n: v2 25%, v3 25%, primary v1 50%" in text, text
    assert "breaker v3: open (worst replica)" in text and "target errors v3: 7" in text, text
