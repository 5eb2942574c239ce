"""The CLI speaks the words of the tools beside it (issue 43): MLflow's champion/challenger
aliases through promote, rollback and status; kubectl's `rollout undo`; tritonserver's
`--model-repository`; one `--server` rule (a scheme says the protocol, a bare HOST:PORT keeps the
command's own). Real rollout state files, a real MLflow sqlite registry beside the repository,
the real CLI; aliases read back through MLflow's own client."""

from __future__ import annotations

import inspect
import json

import pytest
import typer.main
from mlflow import MlflowClient
from typer.testing import CliRunner

from exporter.cli.app import app
from exporter.cli.server_opt import GRPC, HTTP, address
from exporter.records.registry import Registry, default_uri
from tritonguard.core.repository import write_config
from tritonguard.rollout.stores import open_store

MODEL = "m"
GUARD = {"name": MODEL, "backend": "guard", "max_batch_size": 4,
         "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [2]}],
         "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [2]}],
         "parameters": {"target": {"string_value": "m_raw"}}}
runner = CliRunner()
COMMAND = typer.main.get_command(app)


def make_repo(root):
    repo = root / "model_repository"
    write_config(repo / MODEL, GUARD)
    for v in (1, 2, 3):
        (repo / "m_raw" / str(v)).mkdir(parents=True)
        (repo / "m_raw" / str(v) / "manifest.json").write_text(json.dumps({
            "sha256": f"{v:02d}" * 32, "task": "classifier", "created": "2026-01-01T00:00:00+00:00",
            "golden": {"verdict": "PASS", "metrics": {"top1_agreement": 1.0}, "n": 8}}))
    return repo


@pytest.fixture(autouse=True)
def _no_shared_stores(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("TRITONGUARD_STATE_URL", raising=False)
    monkeypatch.delenv("TRITONGUARD_REPOSITORY", raising=False)


def cli(*args: str):
    return runner.invoke(app, list(args))


def champion(repo, alias: str = "champion") -> int:
    uri = default_uri(repo)
    mv = MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version_by_alias(MODEL, alias)
    return int(mv.tags["tritonguard.version"])


def promoted_twice(repo) -> None:
    """v1 then v2 promoted without a gradual rollout (no server needed), v2 with a user alias."""
    for args in (("--version", "1", "--no-rollout"), ("--version", "2", "--to", "challenger"),
                 ("--version", "2", "--to", "champion", "--no-rollout", "--alias", "blue")):
        res = cli("promote", MODEL, *args, "--model-repository", str(repo))
        assert res.exit_code == 0, res.output


def test_promote_and_rollback_move_champion_as_mlflow_reads_it(tmp_path):
    repo = make_repo(tmp_path)
    res = cli("promote", MODEL, "--version", "1", "--to", "challenger", "-r", str(repo))
    assert res.exit_code == 0 and "alias challenger" in res.stdout, res.output
    assert champion(repo, "challenger") == 1 and champion(repo, "staging") == 1  # old name kept
    promoted_twice(repo)
    assert champion(repo) == 2 and champion(repo, "production") == 2 and champion(repo, "blue") == 2
    assert Registry(default_uri(repo)).stage(MODEL, 1) == "ARCHIVED"
    # status shows the aliases (MLflow's name@alias), the deprecated synonyms left out of the text
    res = cli("status", "-r", str(repo))
    flat = " ".join(res.stdout.split())
    assert res.exit_code == 0 and "registry: v1 ARCHIVED, v2 PRODUCTION @blue @champion history:" in flat, res.output
    doc = json.loads(cli("status", "--json", "-r", str(repo)).stdout)
    assert doc["guards"][0]["aliases"] == {"blue": 2, "champion": 2, "production": 2}
    res = cli("rollback", MODEL, "-r", str(repo))
    assert res.exit_code == 0, res.output
    assert champion(repo) == 1 and champion(repo, "production") == 1
    assert champion(repo, "blue") == 2  # the user's alias is the user's to move
    res = cli("promote", MODEL, "--version", "3", "--to", "live", "-r", str(repo))
    assert res.exit_code == 2 and "--to must be staging or production" in " ".join(res.output.split())
    res = cli("promote", MODEL, "--version", "3", "--to", "staging", "--alias", "champion", "-r", str(repo))
    assert res.exit_code == 2 and "managed by the registry" in " ".join(res.output.split()), res.output


def _undo_view(repo) -> dict:
    reg = Registry(default_uri(repo))
    keep = ("type", "version", "from", "to", "archived", "live", "reason", "rollback")
    return {"stages": {i.version: i.stage for i in reg.versions(MODEL)}, "aliases": reg.aliases(MODEL),
            "history": [{k: r.get(k) for k in keep} for r in reg.history(MODEL)],
            "primary": open_store(MODEL, repo).load().primary}


def test_rollout_undo_is_rollback(tmp_path):
    seen = {}
    for how in (("rollback",), ("rollout", "undo")):
        repo = make_repo(tmp_path / how[-1])
        promoted_twice(repo)
        res = cli(*how, MODEL, "--model-repository", str(repo), "--reason", "bad answers")
        assert res.exit_code == 0, (how, res.output)
        seen[how] = (_undo_view(repo), res.stdout)
    (view_a, out_a), (view_b, out_b) = seen.values()
    assert view_a == view_b and out_a == out_b
    assert view_a["primary"] == 1 and view_a["stages"][2] == "ARCHIVED" and view_a["aliases"]["champion"] == 1
    assert view_a["history"][-1]["rollback"] is True and view_a["history"][-1]["reason"] == "bad answers"
    # one implementation: the same function behind both names
    assert inspect.unwrap(COMMAND.commands["rollout"].commands["undo"].callback) is \
        inspect.unwrap(COMMAND.commands["rollback"].callback)


def _commands(group, prefix: tuple[str, ...] = ()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):  # a group (typer vendors its own click: no isinstance)
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def _parse(path: tuple[str, ...], args: list[str]) -> dict:
    cmd = COMMAND
    for name in path:
        cmd = cmd.commands[name]
    return cmd.make_context(" ".join(path), args, resilient_parsing=True).params


def test_model_repository_is_accepted_wherever_repository_is(tmp_path):
    with_repository = [(path, p.name) for path, cmd in _commands(COMMAND) for p in cmd.params
                       if "--repository" in getattr(p, "opts", [])]
    assert len(with_repository) >= 16, with_repository  # rollout's and audit's subcommands included
    for path, name in with_repository:
        params = _parse(path, ["--model-repository", str(tmp_path / "r")])
        assert str(params[name]) == str(tmp_path / "r"), path


# the commands that talk to Triton, and the protocol a bare HOST:PORT means there
SERVER_COMMANDS = {("promote",): HTTP, ("rollback",): HTTP, ("rollout", "undo"): HTTP, ("rollout", "status"): HTTP,
                   ("rollout", "resume"): HTTP, ("status",): HTTP, ("batch",): GRPC}


@pytest.mark.parametrize("path", list(SERVER_COMMANDS), ids=" ".join)
def test_server_with_a_scheme_means_the_same_protocol_in_every_command(path):
    given = ["grpc://triton:8001", "http://triton:8000", "triton:9000"]
    params = _parse(path, [a for s in given for a in ("--server", s)])
    if SERVER_COMMANDS[path] == HTTP:  # HTTP 8000 is gRPC 8001's neighbour; bare stays HTTP, as before
        assert params["server"] == ["http://triton:8000", "http://triton:8000", "triton:9000"]
    else:  # batch scores over gRPC: a bare address stays gRPC, as before
        assert params["server"] == ["triton:8001", "triton:8001", "triton:9000"]
    cmd = COMMAND
    for name in path:
        cmd = cmd.commands[name]
    helps = [p.help for p in cmd.params if "--server" in getattr(p, "opts", [])]
    assert helps and "grpc://HOST:PORT mean HTTP and gRPC in every command" in helps[0]


def test_server_values_that_cannot_be_read_are_usage_errors(tmp_path):
    assert address("https://triton:8443", HTTP) == ("https://triton:8443", None)
    assert address("grpc://[::1]:8001", HTTP)[0] == "http://[::1]:8000"
    for bad, protocol in (("ftp://triton:21", HTTP), ("grpc://triton", HTTP), ("https://triton:8000", GRPC),
                          ("http://triton:8000/prefix", GRPC)):
        with pytest.raises(ValueError):
            address(bad, protocol)
    repo = make_repo(tmp_path)
    res = cli("promote", MODEL, "--version", "2", "--server", "ftp://triton:21", "-r", str(repo))
    assert res.exit_code == 2 and "'ftp://triton:21': the scheme is http://," in res.output, res.output
    res = cli("batch", MODEL, "--input", str(tmp_path), "--output", str(tmp_path / "o"),
              "--server", "http://triton")
    assert res.exit_code == 2 and "'http://triton': this command speaks gRPC" in res.output, res.output
