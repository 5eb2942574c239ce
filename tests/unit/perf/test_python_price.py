"""perf.python_price builds real Python-backend models; the measurement itself needs a server and
perf_analyzer and is run by hand (docs/performance.md has its figures)."""

from __future__ import annotations

import py_compile

import pytest

from perf import python_price
from tritonguard.core.repository import read_config


def test_the_models_burn_what_their_config_says(tmp_path):
    models = python_price.build(tmp_path, [100, 300], [300])
    assert models == {"burn0": (0, False), "burn100": (100, False), "burn300": (300, False),
                      "burn_after300": (300, True)}
    for name, (us, later) in models.items():
        cfg = read_config(tmp_path / name)
        assert cfg["name"] == name and cfg["backend"] == "python" and "dynamic_batching" in cfg
        assert cfg["parameters"]["BURN_US"]["string_value"] == str(us)
        assert cfg["parameters"]["DEFERRED"]["string_value"] == str(int(later))
        py_compile.compile(str(tmp_path / name / "1" / "model.py"), doraise=True)


def test_burning_nothing_or_less_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        python_price.main(["--us", "0"])
    assert exc.value.code == 2 and "positive microseconds" in capsys.readouterr().err
