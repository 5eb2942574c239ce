import numpy as np
import pytest

from tritonguard.core.config import from_params
from tritonguard.core.errors import ConfigError
from tritonguard.core.tensors import ModelSignature, offsets, rows_any
from tritonguard.guard.validation import BatchValidator, ValidationConfig

DIGITS = ModelSignature.from_config({
    "max_batch_size": 8,
    "input": [{"name": "IMAGE", "data_type": "TYPE_FP32", "dims": ["8", "8"]}],
    "output": [{"name": "PROBS", "data_type": "TYPE_FP32", "dims": [10]}],
})
TEXT = ModelSignature.from_config({
    "max_batch_size": 8,
    "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
    "output": [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": [384]}],
})


def img(n=1, value=1.0, dtype=np.float32):
    return {"IMAGE": np.full((n, 8, 8), value, dtype=dtype)}


def validator(sig=DIGITS, **params):
    return BatchValidator(sig, from_params(ValidationConfig, {k: str(v) for k, v in params.items()}, section="validation"))


def test_valid_batch_is_fused_in_order():
    v = validator()
    reqs = [img(2, 1.0), img(1, 2.0), img(3, 3.0)]
    verdict = v.validate(reqs)
    assert verdict.errors == [None, None, None]
    assert verdict.valid == [0, 1, 2]
    assert verdict.sizes == [2, 1, 3]
    assert verdict.fused["IMAGE"].shape == (6, 8, 8)
    assert list(verdict.fused["IMAGE"][:, 0, 0]) == [1, 1, 2, 3, 3, 3]


def test_one_bad_request_does_not_fail_neighbours():
    v = validator(**{"range.IMAGE": "0,16"})
    nan = img(1)
    nan["IMAGE"][0, 3, 4] = np.nan
    reqs = [img(2, 1.0), nan, img(1, 17.0), img(1, 5.0)]
    verdict = v.validate(reqs)
    assert verdict.errors[0] is None and verdict.errors[3] is None
    assert verdict.errors[1].rule == "finite" and "'IMAGE'" in str(verdict.errors[1])
    assert verdict.errors[2].rule == "range" and "[0, 16]" in str(verdict.errors[2])
    assert verdict.valid == [0, 3]
    assert verdict.sizes == [2, 1]
    assert list(verdict.fused["IMAGE"][:, 0, 0]) == [1, 1, 5]


@pytest.mark.parametrize("bad,rule", [
    ({"IMAGE": np.zeros((1, 8, 8), np.float64)}, "dtype"),
    ({"IMAGE": np.zeros((1, 8, 9), np.float32)}, "shape"),
    ({"IMAGE": np.zeros((9, 8, 8), np.float32)}, "batch_size"),
    ({}, "presence"),
    ({"IMAGE": np.full((1, 8, 8), np.inf, np.float32)}, "finite"),
    ({"IMAGE": np.full((1, 8, 8), -np.inf, np.float32)}, "finite"),
])
def test_structural_and_value_rules(bad, rule):
    verdict = validator().validate([img(1), bad])
    assert verdict.errors[0] is None
    assert verdict.errors[1] is not None and verdict.errors[1].rule == rule
    assert verdict.errors[1].code == "INVALID_ARG"


def test_payload_limit():
    v = validator(max_payload_bytes=8 * 8 * 4)
    verdict = v.validate([img(1), img(2)])
    assert verdict.errors[0] is None
    assert verdict.errors[1].rule == "max_payload_bytes"


def test_non_finite_allowed_when_configured():
    verdict = validator(allow_non_finite="true").validate([img(1, np.nan)])
    assert verdict.errors == [None]


def test_bytes_rules():
    v = validator(TEXT, max_bytes_length=10)
    ok = {"TEXT": np.array([[b"hello"]], dtype=object)}
    long = {"TEXT": np.array([[b"x" * 11]], dtype=object)}
    bad_utf8 = {"TEXT": np.array([[b"ok \xff\xfe"]], dtype=object)}
    verdict = v.validate([ok, long, bad_utf8, ok])
    assert verdict.errors[0] is None and verdict.errors[3] is None
    assert verdict.errors[1].rule == "max_bytes_length"
    assert verdict.errors[2].rule == "utf8" and "byte 3" in str(verdict.errors[2])
    assert verdict.fused["TEXT"].shape == (2, 1)


def test_range_config_errors():
    with pytest.raises(ConfigError, match="min,max"):
        from_params(ValidationConfig, {"range.IMAGE": "5"}, section="validation")
    with pytest.raises(ConfigError, match="min 3 > max 1"):
        from_params(ValidationConfig, {"range.IMAGE": "3,1"}, section="validation")
    cfg = from_params(ValidationConfig, {"range.NOPE": "0,1"}, section="validation")
    with pytest.raises(ConfigError, match="validation.range.NOPE names no input"):
        cfg.check_against(DIGITS, "digits")


def test_open_ended_range():
    v = validator(**{"range.IMAGE": "0,"})
    verdict = v.validate([img(1, 1e9), img(1, -1.0)])
    assert verdict.errors[0] is None and verdict.errors[1].rule == "range"


def test_rows_any_maps_rows_to_requests():
    starts = offsets([2, 1, 3])
    mask = np.array([False, False, True, False, False, True])
    assert list(rows_any(mask, starts)) == [False, True, True]
