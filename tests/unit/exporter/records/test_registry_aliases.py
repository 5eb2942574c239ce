"""MLflow's convention for what serves (issue 43): registered-model aliases ``champion`` and
``challenger`` and a ``tritonguard.role`` tag, with the deprecated stage vocabulary (the
``production``/``staging`` aliases, the ``tritonguard.stage`` tag) still written and accepted.
Every assertion reads through MLflow's own client on a real sqlite store, as a user's query would."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from exporter.records.registry import Registry, RegistryError, check_alias, stage_of

SHA = {v: f"{v:02d}" * 32 for v in range(1, 5)}


def manifest(v: int) -> dict:
    return {"sha256": SHA[v], "task": "classifier", "created": "2026-01-01T00:00:00+00:00",
            "golden": {"verdict": "PASS", "metrics": {"top1_agreement": 1.0}, "n": 8}}


@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_SQLALCHEMYSTORE_POOLCLASS", "NullPool")
    return f"sqlite:///{tmp_path / 'reg' / 'mlflow.db'}"


@pytest.fixture
def reg(db):
    reg = Registry(db)
    for v in (1, 2, 3):
        reg.register("m", v, manifest(v), {})
    return reg


def by_alias(db: str, alias: str) -> int:
    """The repository version MLflow's own client finds behind ``alias``."""
    mv = MlflowClient(tracking_uri=db, registry_uri=db).get_model_version_by_alias("m", alias)
    return int(mv.tags["tritonguard.version"])


def roles(db: str) -> dict[int, tuple[str, str]]:
    mvs = MlflowClient(tracking_uri=db, registry_uri=db).search_model_versions("name = 'm'")
    return {int(mv.tags["tritonguard.version"]): (mv.tags["tritonguard.role"], mv.tags["tritonguard.stage"])
            for mv in mvs}


def aliases(db: str) -> set[str]:
    return set(MlflowClient(tracking_uri=db, registry_uri=db).get_registered_model("m").aliases)


def test_champion_and_challenger_follow_promotion_and_rollback(reg, db):
    assert roles(db) == {v: ("draft", "DRAFT") for v in (1, 2, 3)}
    reg.transition("m", 1, "PRODUCTION", "DRAFT")
    assert by_alias(db, "champion") == 1 and by_alias(db, "production") == 1
    # a candidate under test is the challenger (and, deprecated, staging)
    reg.transition("m", 2, "STAGING", "DRAFT")
    assert by_alias(db, "challenger") == 2 and by_alias(db, "staging") == 2
    assert roles(db)[2] == ("challenger", "STAGING")
    # promoted: the new version is champion, the old champion loses it, nobody is challenger
    reg.transition("m", 2, "PRODUCTION", "STAGING")
    assert by_alias(db, "champion") == 2 and by_alias(db, "production") == 2
    assert aliases(db) == {"champion", "production"}
    assert roles(db) == {1: ("archived", "ARCHIVED"), 2: ("champion", "PRODUCTION"), 3: ("draft", "DRAFT")}
    # rolled back: the champion is the previous one again, the rolled-back one archived
    back = reg.rollback("m", reason="error rate")
    assert back.version == 1 and back.tags["tritonguard.role"] == "champion"
    assert by_alias(db, "champion") == 1 and by_alias(db, "production") == 1
    assert roles(db)[1] == ("champion", "PRODUCTION") and roles(db)[2] == ("archived", "ARCHIVED")
    # an existing user's query by the old stage tag still finds what serves
    old = MlflowClient(tracking_uri=db, registry_uri=db).search_model_versions(
        "name = 'm' and tags.`tritonguard.stage` = 'PRODUCTION'")
    assert [mv.tags["tritonguard.version"] for mv in old] == ["1"]
    assert reg.verify_history().ok


def test_both_vocabularies_are_accepted_on_input(reg, db):
    assert [stage_of(w) for w in ("champion", "Production", "challenger", "staging", "draft", "ARCHIVED")] == \
        ["PRODUCTION", "PRODUCTION", "STAGING", "STAGING", "DRAFT", "ARCHIVED"]
    with pytest.raises(RegistryError, match="unknown stage 'live'"):
        stage_of("live")
    reg.transition("m", 1, "challenger", "draft")
    reg.transition("m", 1, "champion", "challenger")
    assert reg.stage("m", 1) == "PRODUCTION" and by_alias(db, "champion") == 1
    assert [(r["from"], r["to"]) for r in reg.history("m") if r["type"] == "transition"] == \
        [("DRAFT", "STAGING"), ("STAGING", "PRODUCTION")]  # the history keeps one vocabulary


def test_user_aliases_now_or_when_the_version_becomes_production(reg, db):
    reg.transition("m", 1, "PRODUCTION", "DRAFT")
    reg.set_aliases("m", 2, ["qa"])  # now
    assert by_alias(db, "qa") == 2
    reg.set_aliases("m", 2, ["blue", "stable"], on_production=True)  # pending until it serves
    assert "blue" not in aliases(db)
    reg.transition("m", 2, "STAGING", "DRAFT")
    assert "blue" not in aliases(db)
    reg.transition("m", 2, "PRODUCTION", "STAGING")
    assert by_alias(db, "blue") == 2 and by_alias(db, "stable") == 2 and by_alias(db, "champion") == 2
    assert "tritonguard.pending_aliases" not in reg.get("m", 2).tags
    assert reg.aliases("m") == {"blue": 2, "champion": 2, "production": 2, "qa": 2, "stable": 2}
    for bad in ("champion", "production", "latest", "v3", "a b", ""):
        with pytest.raises(RegistryError, match="alias"):
            check_alias(bad)


def test_a_registry_written_before_champion_is_read_and_completed(reg, db):
    """What an older tritonguard left: the `production` alias and the stage tag only."""
    reg.transition("m", 1, "PRODUCTION", "DRAFT")
    c = MlflowClient(tracking_uri=db, registry_uri=db)
    mv1 = reg.get("m", 1).mlflow_version
    c.delete_registered_model_alias("m", "champion")
    c.delete_model_version_tag("m", mv1, "tritonguard.role")
    assert reg.production("m") == 1  # read through the old alias
    n = len(reg.history("m"))
    info, moved = reg.ensure_production("m", 1)
    assert not moved and len(reg.history("m")) == n  # nothing moved: no history record
    assert by_alias(db, "champion") == 1 and roles(db)[1] == ("champion", "PRODUCTION")
