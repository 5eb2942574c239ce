"""One `route` command is one revision of the rollout state (issue 45 item 6: the walk-through
went r3 -> r5 over one `route`; the revision between was the guard's, recording v2's goldens).
Real files, the real CLI; the guard's write is made through the store as the guard makes it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from exporter.cli.app import app
from tests.unit.exporter.rollout.test_route import repo  # noqa: F401 - the fixture
from tritonguard.rollout.stores import open_store


def _route(repo, *args: str) -> dict:  # noqa: F811 - the fixture's name
    res = CliRunner().invoke(app, ["route", "m", "-r", str(repo), *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_each_route_is_one_revision_and_the_guards_write_is_its_own(repo):  # noqa: F811
    first = _route(repo, "--primary", "1")["revision"]
    assert _route(repo, "--candidate", "2", "--share", "0.1")["revision"] == first + 1

    def golden(state):  # what the guard does the first time v2 is routed to
        state.goldens.setdefault("2", {"verdict": "PASS", "metrics": {}, "checked_at": 0.0})
        return state

    open_store("m", repo).update(golden, by="guard:m")
    stopped = _route(repo, "--candidate", "0")
    assert stopped["revision"] == first + 3 and stopped["updated_by"] == "cli", stopped
    assert "2" in stopped["goldens"]  # the revision between, shown in the summary as `goldens v2`
    assert _route(repo)["revision"] == first + 3  # showing writes nothing
