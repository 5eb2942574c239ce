"""The guard's load logs one line naming each non-default setting and the layer it came from
(issue 43 item 4): a pyproject.toml in the model repository's parent folder is read without being
asked for, so the server says what it changed. Secrets show as ``<set>``, never their value."""

from __future__ import annotations

import logging

import pytest

from tritonguard.core.config import SECRET, model_parameters, shown_value
from tritonguard.core.repository import read_config
from tritonguard.guard.config import load_guard_config

CONFIG_PBTXT = """
name: "digits"
backend: "guard"
max_batch_size: 64
input { name: "IMAGE" data_type: TYPE_FP32 dims: [ 8, 8 ] }
output { name: "PROBS" data_type: TYPE_FP32 dims: [ 10 ] }
parameters { key: "target" value { string_value: "digits_raw" } }
parameters { key: "validation.range.IMAGE" value { string_value: "0,16" } }
parameters { key: "cache.enabled" value { string_value: "true" } }
parameters { key: "breaker.max_error_rate" value { string_value: "0.05" } }
"""

PASSWORD = "hunter2-s3cr3t"
WEBHOOK_TOKEN = "T000-B000-XXXXsecretpath"

PYPROJECT = f"""
[project]
name = "my-models"

[tool.tritonguard.breaker]
window = 100
min_requests = 20

[tool.tritonguard.cache]
enabled = false
l3_url = "redis://:{PASSWORD}@127.0.0.1:6379/0"
key_env = "MY_CACHE_KEY"

[tool.tritonguard.routing]
alert_webhook = "https://hooks.example.com/services/{WEBHOOK_TOKEN}"
"""


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def lines():
    # the handler on the module's own logger: the backends' "tritonguard" logger may not propagate
    logger, handler = logging.getLogger("tritonguard.guard.config"), Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def layout(tmp_path):
    """<root>/pyproject.toml beside <root>/model_repository/digits/config.pbtxt."""
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    model_dir = tmp_path / "model_repository" / "digits"
    model_dir.mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(CONFIG_PBTXT)
    return tmp_path, model_dir


def test_the_load_logs_each_non_default_setting_and_its_source(layout, lines):
    root, model_dir = layout
    env = {"TRITONGUARD_BREAKER__MIN_OFF_S": "30"}
    params, config = load_guard_config(model_parameters(read_config(model_dir)), model_dir.parent, env, "digits")
    assert config.breaker.window == 100 and config.cache.enabled is True and config.breaker.min_off_s == 30

    assert len(lines) == 1, lines
    line = lines[0]
    py = f"{(root / 'pyproject.toml').resolve()} [tool.tritonguard]"
    assert line.startswith("digits: non-default settings: ")
    listed = line.removeprefix("digits: non-default settings: ").split(", ")
    assert listed == [  # by key, each with the layer that won
        "breaker.min_off_s=30 (environment (TRITONGUARD_*))",
        f"breaker.window=100 ({py})",
        "cache.enabled=true (config.pbtxt)",  # config.pbtxt beats the pyproject's false
        f"cache.key_env=MY_CACHE_KEY ({py})",  # the name of a variable, not the key
        f"cache.l3_url={SECRET} ({py})",
        f"routing.alert_webhook={SECRET} ({py})",
        "target=digits_raw (config.pbtxt)",
        "validation.range.IMAGE=0,16 (config.pbtxt)",
    ]
    # set, but to the default: not listed (breaker.min_requests=20, breaker.max_error_rate=0.05)
    assert "min_requests" not in line and "max_error_rate" not in line
    assert PASSWORD not in line and WEBHOOK_TOKEN not in line and "hooks.example.com" not in line


def test_a_guard_with_defaults_only_says_so(tmp_path, lines):
    load_guard_config({"target": "t"}, tmp_path / "repo", {}, "m")
    assert lines == ["m: non-default settings: target=t (config.pbtxt)"]


@pytest.mark.parametrize(("key", "value"), [
    ("cache.l3_url", "redis://user:pw-Secret9@10.0.0.1:6379/0"),
    ("cache.l3_url", "s3://bucket/prefix?X-Amz-Signature=abc123Secret9"),
    ("tracing.endpoint", "http://collector:4318?token=abc123Secret9"),
    ("tenancy.jwt_secret", "abc123Secret9"),
    ("feedback.api_key", "abc123Secret9"),
    ("x.password", "abc123Secret9"),
])
def test_secret_values_are_never_shown(key, value):
    assert shown_value(key, value) == SECRET


@pytest.mark.parametrize(("key", "value"), [
    ("cache.l3_url", "redis://127.0.0.1:6379/0"),
    ("tracing.endpoint", "http://127.0.0.1:4318"),
    ("tenancy.jwt_secret_env", "TRITONGUARD_TENANT_JWT_SECRET"),
    ("tenancy.key_header", "x-tritonguard-api-key"),
    ("tenancy.keys_file", "/etc/tritonguard/keys.json"),
])
def test_where_a_secret_is_and_plain_urls_are_shown(key, value):
    assert shown_value(key, value) == value


def test_long_values_are_cut():
    shown = shown_value("tenancy.quotas", '{"acme": {"rps": 5}}' * 10)
    assert len(shown) == 80 and shown.endswith("\u2026")
