"""A client's stop request (tritonguard/guard/stream/stops.py): the stop file it leaves for the
guard instance that holds the generation, matched by tenant and request id, taken once."""

from __future__ import annotations

import json
import os
import time

import pytest

from tritonguard.core.errors import InvalidInput, TritonGuardError
from tritonguard.generation.contract import STOP_PREFIX
from tritonguard.generation.engine import STOP_TTL_S
from tritonguard.guard.stages.tenancy import TenancyStage
from tritonguard.guard.stream.stops import FILE_PREFIX, ClientStops, is_stop
from tritonguard.privacy.tenancy.auth import new_api_key
from tritonguard.privacy.tenancy.config import TenancyConfig


class Request:
    """What the guard reads of a Triton request here: its id."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def request_id(self) -> str:
        return self.rid


def tenant_of(**tenancy):
    """The tenancy stage's own resolution, as the guard hands it to its stops."""
    return TenancyStage(TenancyConfig(**tenancy), metrics=None, label=str).tenant_of


def stops(tmp_path, **tenancy) -> ClientStops:
    return ClientStops("g", tenant_of(**tenancy), directory=tmp_path)


def test_a_stop_reaches_the_generation_of_its_tenant_once(tmp_path):
    s = stops(tmp_path)
    acme = s.watch(Request("oai-1"), "acme")
    other = s.watch(Request("oai-1"), "globex")
    assert acme is not None and other is not None and acme != other
    assert not s.taken(acme)  # nothing asked yet
    s.ask(STOP_PREFIX + "oai-1", {"tenant": "acme"})
    assert not s.taken(other), "a stop of acme's must not stop another tenant's generation of the same id"
    assert s.taken(acme) and not s.taken(acme), "a stop is taken once"
    # an instance of the guard that did not take the request sees the same file (each is its own process)
    s.ask(STOP_PREFIX + "oai-1", {"tenant": "acme"})
    twin = ClientStops("g", tenant_of(), directory=tmp_path)
    assert twin.taken(twin.watch(Request("oai-1"), "acme"))
    # no client text in a file name
    s.ask(STOP_PREFIX + "../../etc/x y", {"tenant": "acme"})
    assert all(n.startswith(FILE_PREFIX) and n[len(FILE_PREFIX):].isalnum() for n in os.listdir(tmp_path))


def test_a_generation_without_an_id_or_directory_cannot_be_stopped_this_way(tmp_path):
    assert stops(tmp_path).watch(Request(""), "acme") is None
    nowhere = ClientStops("g", tenant_of(enabled=False), directory=tmp_path)
    nowhere.directory = None
    assert nowhere.watch(Request("oai-1"), "default") is None
    with pytest.raises(TritonGuardError, match="cannot be taken here") as info:
        nowhere.ask(STOP_PREFIX + "oai-1", {})
    assert info.value.code == "UNAVAILABLE"


def test_a_stop_naming_no_id_or_with_a_bad_credential_is_refused(tmp_path):
    with pytest.raises(InvalidInput, match="names the id of the generation") as info:
        stops(tmp_path).ask(STOP_PREFIX, {})
    assert info.value.code == "INVALID_ARG"
    key, digest = new_api_key()
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"acme": [digest]}))
    folder = tmp_path / "stops"
    folder.mkdir()
    keyed = ClientStops("g", tenant_of(auth="api_key", keys_file=str(keys)), directory=folder)
    with pytest.raises(InvalidInput) as refused:
        keyed.ask(STOP_PREFIX + "oai-1", {"x-tritonguard-api-key": "sk-not-a-key"})
    assert "sk-not-a-key" not in str(refused.value) and not os.listdir(folder)
    keyed.ask(STOP_PREFIX + "oai-1", {"x-tritonguard-api-key": key})
    assert keyed.taken(keyed.watch(Request("oai-1"), "acme"))


def test_untaken_stops_are_pruned_after_their_ttl(tmp_path):
    s = stops(tmp_path)
    s.ask(STOP_PREFIX + "gone", {})  # its generation had ended: nobody takes it
    old = s.watch(Request("gone"), "default")
    past = time.time() - STOP_TTL_S - 5
    os.utime(old, (past, past))
    (tmp_path / "tg-0123").touch()  # a generator's stop file: not the guard's to prune
    os.utime(tmp_path / "tg-0123", (past, past))
    s._pruned = 0.0
    s.ask(STOP_PREFIX + "fresh", {})
    assert not old.exists() and (tmp_path / "tg-0123").exists()
    assert s.watch(Request("fresh"), "default").exists()


def test_only_a_stop_prefix_is_a_stop():
    assert is_stop(STOP_PREFIX + "x") and not is_stop("oai-1") and not is_stop("")
