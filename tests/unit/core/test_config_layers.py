"""defaults < [tool.tritonguard] in pyproject.toml < TRITONGUARD_* < config.pbtxt, in one place."""

from __future__ import annotations

import json

import pytest

from tritonguard.core.config import layered_parameters, pyproject_parameters, with_source
from tritonguard.core.errors import ConfigError
from tritonguard.guard.config import GuardConfig

PYPROJECT = """
[project]
name = "x"

[tool.ruff]
line-length = 100

[tool.tritonguard]
placement = "bls"

[tool.tritonguard.validation]
max_bytes_length = 1000
max_payload_bytes = 5000
allow_non_finite = true

[tool.tritonguard.validation.range]
IMAGE = "0,16"

[tool.tritonguard.redaction]
recognizers = ["EMAIL", "PHONE"]

[tool.tritonguard.redaction.pattern]
EMPLOYEE = 'EMP-\\d{6}'

[tool.tritonguard.tenancy.quotas]
acme = { rps = 5, burst = 10 }
"*" = { rps = 1 }

[tool.tritonguard.cache]
enabled = true
l1_ttl_s = 2.5
"""


@pytest.fixture
def layout(tmp_path):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    repo = tmp_path / "model_repository"
    repo.mkdir()
    return tmp_path, repo


def test_pyproject_is_flattened_to_section_keys(layout):
    root, _ = layout
    p = pyproject_parameters(root / "pyproject.toml")
    assert p["placement"] == "bls"
    assert p["validation.max_bytes_length"] == "1000" and p["validation.allow_non_finite"] == "true"
    assert p["validation.range.IMAGE"] == "0,16"
    assert p["redaction.recognizers"] == "EMAIL,PHONE"
    assert p["redaction.pattern.EMPLOYEE"] == r"EMP-\d{6}"
    assert json.loads(p["tenancy.quotas"]) == {"acme": {"rps": 5, "burst": 10}, "*": {"rps": 1}}
    assert p["cache.enabled"] == "true" and p["cache.l1_ttl_s"] == "2.5"
    assert not any(k.startswith(("ruff", "project")) for k in p)


def test_precedence_defaults_pyproject_env_model(layout):
    _, repo = layout
    env = {"TRITONGUARD_VALIDATION__MAX_BYTES_LENGTH": "2000", "TRITONGUARD_VALIDATION__MAX_PAYLOAD_BYTES": "6000"}
    params = layered_parameters({"target": "t", "validation.max_payload_bytes": "7000"}, repo, env)
    cfg = GuardConfig.from_parameters(params, "m")
    assert cfg.validation.max_bytes_length == 2000  # env beats pyproject
    assert cfg.validation.max_payload_bytes == 7000  # config.pbtxt beats env
    assert cfg.validation.allow_non_finite is True  # pyproject beats the default
    assert cfg.validation.require_utf8 is True  # the default
    assert cfg.tenancy.quotas["acme"].burst == 10 and cfg.redaction.recognizers == ("EMAIL", "PHONE")
    assert params.source_of("validation.max_bytes_length").startswith("environment")
    assert params.source_of("validation.max_payload_bytes") == "config.pbtxt"
    assert "pyproject.toml" in params.source_of("cache.enabled")
    assert params.source_of("cache.l3_url") == "defaults"


def test_explicit_pyproject_from_env(layout, tmp_path):
    other = tmp_path / "elsewhere.toml"
    other.write_text("[tool.tritonguard.cache]\nenabled = false\n")
    _, repo = layout
    params = layered_parameters({"target": "t"}, repo, {"TRITONGUARD_PYPROJECT": str(other)})
    assert params == {"target": "t", "cache.enabled": "false"}
    with pytest.raises(ConfigError, match="TRITONGUARD_PYPROJECT=.*no such file"):
        layered_parameters({}, repo, {"TRITONGUARD_PYPROJECT": str(tmp_path / "missing.toml")})


def test_no_pyproject_no_layer(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    assert layered_parameters({"target": "t"}, repo, {}) == {"target": "t"}


def test_unknown_key_from_pyproject_is_named_with_its_source(layout):
    root, repo = layout
    (root / "pyproject.toml").write_text("[tool.tritonguard.cache]\nenabeld = true\n")
    params = layered_parameters({"target": "t"}, repo, {})
    with pytest.raises(ConfigError) as err:
        GuardConfig.from_parameters(params, "m")
    msg = with_source(str(err.value), params)
    assert "'cache.enabeld'" in msg and "pyproject.toml [tool.tritonguard]" in msg


def test_bad_toml_is_a_config_error(layout):
    root, repo = layout
    (root / "pyproject.toml").write_text("[tool.tritonguard\n")
    with pytest.raises(ConfigError, match="cannot read"):
        layered_parameters({}, repo, {})


def test_mistyped_value_from_env_is_named_with_its_source(layout):
    _, repo = layout
    params = layered_parameters({"target": "t"}, repo, {"TRITONGUARD_CACHE__L1_ENTRIES": "many"})
    with pytest.raises(ConfigError) as err:
        GuardConfig.from_parameters(params, "m")
    msg = with_source(str(err.value), params)
    assert "'cache.l1_entries'" in msg and "valid integer" in msg and "'many'" in msg
    assert msg.endswith("(set in environment (TRITONGUARD_*))")
