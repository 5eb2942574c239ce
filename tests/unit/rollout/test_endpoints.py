"""Versions of a stream guard's target served at a URL (tritonguard.rollout.endpoints): the
``endpoints.json`` declarations beside the target's config.pbtxt, the guards' view of them, the
exporter's command that writes them (`exporter endpoint`, through the Typer app), what `promote` learns from them (no Triton load, no offline
run: INCONCLUSIVE, the live gates decide), and a guard's calls routed by version: a declared
version to its URL, every other one as the placement says (real HTTP servers on loopback ports)."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
from typer.testing import CliRunner

from examples import generator as example
from exporter.cli.app import app
from exporter.cli.endpoint_cmd import EndpointJudge
from exporter.rollout.generation import judge_generation
from exporter.rollout.judge import INCONCLUSIVE
from exporter.rollout.serving import models_to_load
from tritonguard.core.errors import TargetError
from tritonguard.core.repository import write_config
from tritonguard.guard.stream.openai_target import OpenAIClient, VersionTargets
from tritonguard.guard.stream.target import TargetCalls
from tritonguard.rollout.endpoints import (
    ENDPOINTS_FILE,
    JUDGES,
    Endpoint,
    EndpointError,
    EndpointsView,
    declare,
    read_endpoints,
    withdraw,
)


class Fixed(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible ``/completions`` that streams its server's ``words`` (one SSE event
    each, then usage and [DONE]) and records each request's body."""

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.server.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for word in self.server.words:
            self.wfile.write(b"data: " + json.dumps({"choices": [{"text": word}]}).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"completion_tokens": len(self.server.words)}}
        self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def servers():
    """Two OpenAI-compatible servers: 'triton' (the placement's target) and 'outside'."""
    started = {}
    for name in ("triton", "outside"):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fixed)
        srv.words, srv.bodies = [f"{name} ", "says ", "hi"], []
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started[name] = srv
    yield started
    for srv in started.values():
        srv.shutdown()
        srv.server_close()


def url_of(srv) -> str:
    return f"http://127.0.0.1:{srv.server_port}/v1"


# -- the declarations ---------------------------------------------------------------------------
def test_declarations_are_written_read_and_withdrawn(tmp_path):
    target = tmp_path / "tinylm_raw"
    (target / "1").mkdir(parents=True)
    declare(target, Endpoint(version=7, url="http://10.0.0.5:8000/v1/", model="llama", api_key_env="VLLM_KEY"))
    declare(target, Endpoint(version=9, url="https://h/v1"))
    doc = json.loads((target / ENDPOINTS_FILE).read_text())
    assert doc == {"format_version": 1, "versions": {
        "7": {"url": "http://10.0.0.5:8000/v1", "model": "llama", "api_key_env": "VLLM_KEY", "judge": "task"},
        "9": {"url": "https://h/v1", "judge": "task"}}}
    got = read_endpoints(target)
    manifest = got[7].manifest("tinylm_raw")
    assert set(got) == {7, 9} and got[7].model == "llama" and manifest["endpoint"] == {
        "url": "http://10.0.0.5:8000/v1", "model": "llama"}
    # the registry binds the number to what is served (a manifest's sha256): another URL, another hash
    assert len(manifest["sha256"]) == 64 and manifest["task"] == "generation"
    assert Endpoint(version=7, url="http://10.0.0.6:8000/v1", model="llama").manifest("tinylm_raw")["sha256"] \
        != manifest["sha256"]
    assert withdraw(target, 9) and not withdraw(target, 9) and set(read_endpoints(target)) == {7}
    # a Triton version folder keeps its number: Triton would try to load a folder without a model
    with pytest.raises(EndpointError, match="v1 is a version folder"):
        declare(target, Endpoint(version=1, url="http://h:1/v1"))
    assert read_endpoints(tmp_path / "nothing") == {}


# a password that no path of a run holds: "pw" was in a run folder's random name once (run 53,
# /tmp/tritonguard-lanes-ym4rqxpw), and the messages name the file
PASSWORD = "Leaked-Pa55"


@pytest.mark.parametrize(("entry", "needle"), [
    ({"url": f"http://user:{PASSWORD}@h:1/v1"}, "must not carry credentials"),
    ({"url": "ftp://h/v1"}, r"must be http\(s\)://"),
    ({"url": "http://h:1/v1", "api_key": "sk-secret"}, "unknown key"),
    ({"url": "http://h:1/v1", "api_key_env": "A", "api_key_file": "/k"}, "exclude each other"),
    ({"url": "http://h:1/v1", "judge": "vibes"}, "judge must be one of"),
])
def test_a_bad_declaration_is_refused_naming_it(tmp_path, entry, needle):
    (tmp_path / ENDPOINTS_FILE).write_text(json.dumps({"format_version": 1, "versions": {"7": entry}}))
    with pytest.raises(EndpointError, match=needle) as err:
        read_endpoints(tmp_path)
    assert PASSWORD not in str(err.value) and "sk-secret" not in str(err.value)


def test_the_guards_view_follows_the_file_and_keeps_the_last_good_one(tmp_path):
    now = [0.0]
    view = EndpointsView(tmp_path, check_s=1.0, clock=lambda: now[0])
    assert view.get(7) is None
    declare(tmp_path, Endpoint(version=7, url="http://h:1/v1"))
    assert view.get(7) is None  # looked at most once a second
    now[0] = 1.0
    assert view.get(7).url == "http://h:1/v1"
    (tmp_path / ENDPOINTS_FILE).write_text("{broken")
    now[0] = 2.0
    assert view.get(7).url == "http://h:1/v1"  # a broken file: the last good declarations stay
    (tmp_path / ENDPOINTS_FILE).unlink()
    now[0] = 3.0
    assert view.get(7) is None


# -- a guard's calls, routed by version -----------------------------------------------------------
def test_a_declared_version_is_called_at_its_url_the_others_as_placed(tmp_path, servers, monkeypatch):
    target = tmp_path / "tinylm_raw"
    placed = OpenAIClient(url_of(servers["triton"]), "t", guard="g", target="tinylm_raw")
    remote = VersionTargets(target, guard="g", target="tinylm_raw", timeout_s=5,
                            view=EndpointsView(target, check_s=0))
    calls = TargetCalls(name="g", target="tinylm_raw", local=placed, idle_s=5, remote=remote)
    sampling = json.dumps({"max_tokens": 3, "temperature": 0})
    assert calls.run_text(7, "p", sampling) == "triton says hi"  # not declared: as placed
    declare(target, Endpoint(version=7, url=url_of(servers["outside"]), model="gpt-x"))
    assert calls.run_text(7, "p", sampling) == "outside says hi"
    assert calls.run_text(4, "p", sampling) == "triton says hi"
    assert servers["outside"].bodies[-1]["model"] == "gpt-x" and servers["outside"].bodies[-1]["max_tokens"] == 3
    # a declaration whose key is not there: that version fails as unavailable (the guard falls
    # back, its breaker counts it), the others are untouched
    monkeypatch.delenv("TG_TEST_MISSING_KEY", raising=False)
    declare(target, Endpoint(version=8, url=url_of(servers["outside"]), api_key_env="TG_TEST_MISSING_KEY"))
    with pytest.raises(TargetError, match="'TG_TEST_MISSING_KEY', which is not set") as failed:
        calls.run_text(8, "p", sampling)
    assert failed.value.code == "UNAVAILABLE"
    withdraw(target, 7)
    assert calls.run_text(7, "p", sampling) == "triton says hi"  # withdrawn: as placed again
    remote.close()


# -- what the exporter learns from them ----------------------------------------------------------
def _guarded_repo(tmp_path, placement: str = "bls"):
    repo = tmp_path / "repo"
    write_config(repo / "tinylm", example.stream_guard_config("tinylm", "tinylm_raw", placement=placement))
    (repo / "tinylm_raw" / "1").mkdir(parents=True)
    return repo


def test_the_command_declares_a_version_and_refuses_misuse(tmp_path):
    repo = _guarded_repo(tmp_path)

    def endpoint(*args: str):
        return CliRunner().invoke(app, ["endpoint", *args, "--repository", str(repo)])

    res = endpoint("tinylm", "7", "--url", "http://127.0.0.1:9/v1/", "--model", "m", "--api-key-env", "K")
    assert res.exit_code == 0, res.output
    assert "tinylm: v7 of 'tinylm_raw' is served at http://127.0.0.1:9/v1 (model 'm')" in res.stdout
    got = read_endpoints(repo / "tinylm_raw")[7]
    assert (got.model, got.api_key_env, got.judge) == ("m", "K", "task")
    res = endpoint("tinylm", "9", "--url", "http://h:1/v1", "--judge", "equivalence", "--model-repository", str(repo))
    assert res.exit_code == 0 and read_endpoints(repo / "tinylm_raw")[9].judge == "equivalence", res.output
    before = (repo / "tinylm_raw" / ENDPOINTS_FILE).read_bytes()
    for args, needle in ((["tinylm", "1", "--url", "http://h:1/v1"], "v1 is a version folder"),
                         (["tinylm", "8"], "--url is required"),
                         (["tinylm", "8", "--url", "http://u:secret@h:1/v1"], "must not carry credentials"),
                         (["tinylm", "8", "--url", "http://h:1/v1", "--api-key-env", "A", "--api-key-file", "/k"],
                          "exclude each other"),
                         (["tinylm_raw", "8", "--url", "http://h:1/v1"], "no model 'tinylm_raw'"),
                         (["nosuch", "8", "--remove"], "no model 'nosuch'"),
                         (["tinylm", "8", "--remove"], "not declared at a URL")):
        res = endpoint(*args)
        assert res.exit_code == 2, (args, res.output)
        assert needle in res.stderr and res.stderr.count("\n") == 1 and "secret" not in res.output, res.output
        assert "Traceback" not in res.output
    assert (repo / "tinylm_raw" / ENDPOINTS_FILE).read_bytes() == before  # a refusal changes nothing
    res = endpoint("tinylm", "7", "--judge", "vibes", "--url", "http://h:1/v1")
    assert res.exit_code == 2 and "vibes" in res.stderr  # Click's usage error: the same code
    res = endpoint("tinylm", "7", "--remove")
    assert res.exit_code == 0 and "no longer served at a URL" in res.stdout, res.output
    assert set(read_endpoints(repo / "tinylm_raw")) == {9}
    assert tuple(j.value for j in EndpointJudge) == JUDGES  # the command offers every judge there is


def test_promote_loads_nothing_and_judges_a_url_version_live(tmp_path):
    repo = _guarded_repo(tmp_path)
    declare(repo / "tinylm_raw", Endpoint(version=7, url="http://127.0.0.1:9/v1"))
    assert models_to_load(repo, "tinylm", 1) == [("tinylm_raw", 1)]
    assert models_to_load(repo, "tinylm", 7) == []  # nothing of it runs in Triton
    # no artifact and no eval data here: a Triton version could not be judged at all (JudgeError);
    # the URL version is INCONCLUSIVE, for the live gates to decide
    res = judge_generation(repo, "tinylm_raw", 1, 7, judge="task")
    assert res.verdict == INCONCLUSIVE and "served at http://127.0.0.1:9/v1" in res.reason


def test_route_takes_a_url_version_as_a_version_of_the_target(tmp_path):
    from exporter.rollout.route import RouteChange, RouteError, apply

    repo = _guarded_repo(tmp_path)
    with pytest.raises(RouteError, match="v7 is not a version"):
        apply(repo, "tinylm", RouteChange(primary=7))
    declare(repo / "tinylm_raw", Endpoint(version=7, url="http://127.0.0.1:9/v1"))
    assert apply(repo, "tinylm", RouteChange(primary=7)).primary == 7  # e.g. promote --no-rollout


def test_a_url_version_routed_by_hand_is_compared_as_declared(tmp_path):
    """`route --candidate 7` records the declared judge: with none, the guards judged v7 for
    equivalence and its breaker tripped on disagreement with a Triton primary (validator_fail,
    20 of 20), so it took no more traffic, as a candidate or as the primary."""
    from exporter.rollout.route import RouteChange, apply

    repo = _guarded_repo(tmp_path)
    declare(repo / "tinylm_raw", Endpoint(version=7, url="http://127.0.0.1:9/v1"))
    declare(repo / "tinylm_raw", Endpoint(version=8, url="http://127.0.0.1:9/v1", judge="equivalence"))
    (repo / "tinylm_raw" / "2").mkdir()
    assert apply(repo, "tinylm", RouteChange(primary=1)).judge_of(1)["judge"] == "equivalence"
    assert apply(repo, "tinylm", RouteChange(candidate=7, share=0.5)).judge_of(7) == {"judge": "task"}
    assert apply(repo, "tinylm", RouteChange(candidate=8, share=0.5)).judge_of(8) == {"judge": "equivalence"}
    state = apply(repo, "tinylm", RouteChange(candidate=2, share=0.5))  # a Triton version: as before
    assert "2" not in state.judges and state.judge_of(2)["judge"] == "equivalence"
