import pytest

from tritonguard.core.config import env_parameters, from_params, model_parameters, split_parameters
from tritonguard.core.errors import ConfigError
from tritonguard.guard.config import GuardConfig
from tritonguard.models.engines import EngineConfig


def params(**kv):
    return {k.replace("__", "."): str(v) for k, v in kv.items()}


def test_guard_config_from_parameters():
    cfg = GuardConfig.from_parameters(
        params(target="digits_raw", placement="inprocess", validation__max_payload_bytes=100,
               **{"validation__range.IMAGE": "0,16"}, runtime__intra_op_threads=2), "digits")
    assert cfg.target.target == "digits_raw"
    assert cfg.target.placement == "inprocess"
    assert cfg.validation.max_payload_bytes == 100
    assert cfg.validation.range == {"IMAGE": (0.0, 16.0)}
    assert cfg.runtime.intra_op_threads == 2


@pytest.mark.parametrize("key", ["targt", "validation.max_payload", "nosuch.section", "runtime.threads"])
def test_unknown_key_is_named(key):
    with pytest.raises(ConfigError) as err:
        GuardConfig.from_parameters({"target": "t", key: "1"}, "digits")
    assert f"'{key}'" in str(err.value)
    assert "model 'digits'" in str(err.value)


def test_missing_target_and_bad_values():
    with pytest.raises(ConfigError, match="'target' is required"):
        GuardConfig.from_parameters({}, "m")
    with pytest.raises(ConfigError, match="placement must be"):
        GuardConfig.from_parameters({"target": "t", "placement": "elsewhere"}, "m")
    with pytest.raises(ConfigError, match="validation.max_payload_bytes.*valid integer.*'lots'"):
        GuardConfig.from_parameters({"target": "t", "validation.max_payload_bytes": "lots"}, "m")
    with pytest.raises(ConfigError, match="validation.allow_non_finite.*true/false"):
        GuardConfig.from_parameters({"target": "t", "validation.allow_non_finite": "maybe"}, "m")


def test_model_parameters_and_split():
    cfg = {"parameters": {"target": {"string_value": "x"}, "validation.max_bytes_length": {"string_value": "5"}}}
    p = model_parameters(cfg)
    assert p == {"target": "x", "validation.max_bytes_length": "5"}
    groups = split_parameters(p, ("", "validation"), model="m")
    assert groups == {"": {"target": "x"}, "validation": {"max_bytes_length": "5"}}


def test_env_layer_sits_below_model_parameters():
    env = {"TRITONGUARD_VALIDATION__MAX_BYTES_LENGTH": "7", "TRITONGUARD_HOME": "/x", "OTHER": "1"}
    assert env_parameters(environ=env) == {"validation.max_bytes_length": "7"}
    merged = {**env_parameters(environ=env), "validation.max_bytes_length": "9", "target": "t"}
    assert GuardConfig.from_parameters(merged, "m").validation.max_bytes_length == 9


def test_engine_config_validation():
    assert from_params(EngineConfig, {"providers": "CPUExecutionProvider, X"}).providers == ("CPUExecutionProvider", "X")
    with pytest.raises(ConfigError, match="graph_optimization"):
        from_params(EngineConfig, {"graph_optimization": "max"})


def test_optional_fields_coerce():
    from dataclasses import dataclass

    @dataclass(kw_only=True)
    class Opt:
        limit: float | None = None

    assert from_params(Opt, {"limit": "2.5"}).limit == 2.5
    assert from_params(Opt, {"limit": "none"}).limit is None
