"""The intake backend's guard rail and the layout helpers that find a guard behind an ensemble."""

from __future__ import annotations

import json

import pytest

from exporter.build import layout
from tritonguard.core import repository
from tritonguard.models.intake import IntakeModel

GUARD = {"name": "t_guard", "backend": "guard", "max_batch_size": 8,
         "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": ["1"]}],
         "output": [{"name": "E", "data_type": "TYPE_FP32", "dims": ["4"]},
                    {"name": "SERVED_BY", "data_type": "TYPE_STRING", "dims": ["1"]}],
         "parameters": {"target": {"string_value": "t_raw"}, "serves_as": {"string_value": "t"}}}


def test_intake_refuses_a_batcher(tmp_path):
    cfg = {**layout.intake_config("t_intake", GUARD), "dynamic_batching": {}}
    args = {"model_name": "t_intake", "model_repository": str(tmp_path / "t_intake")}  # as Triton passes them
    with pytest.raises(ValueError, match="must not batch"):
        IntakeModel().initialize({**args, "model_config": json.dumps(cfg)})
    IntakeModel().initialize({**args, "model_config": json.dumps(layout.intake_config("t_intake", GUARD))})


def test_intake_outputs_are_its_inputs_and_the_front_keeps_the_guards_interface():
    intake = layout.intake_config("t_intake", GUARD)
    assert [o["name"] for o in intake["output"]] == ["TEXT"] and "dynamic_batching" not in intake
    front = layout.front_config("t", GUARD, "t_intake", "t_guard")
    assert front["input"] == GUARD["input"] and front["output"] == GUARD["output"]
    layout.render(intake)
    layout.render(front)
    assert layout.needs_intake(GUARD) and not layout.needs_intake(
        {**GUARD, "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": ["4"]}]})


def test_guard_dir_resolves_the_public_name(tmp_path):
    repository.write_config(tmp_path / "t_guard", GUARD)
    repository.write_config(tmp_path / "t_intake", layout.intake_config("t_intake", GUARD))
    repository.write_config(tmp_path / "t", layout.front_config("t", GUARD, "t_intake", "t_guard"))
    found = repository.guard_dir(tmp_path, "t")
    assert found is not None and found[0] == tmp_path / "t_guard"
    assert repository.guard_dir(tmp_path, "t_guard")[0] == tmp_path / "t_guard"
    assert repository.guard_dir(tmp_path, "t_intake") is None
    assert repository.guard_dir(tmp_path, "missing") is None
    assert repository.holds_state(tmp_path / "t") and not repository.holds_state(tmp_path / "t_intake")


def test_an_unreadable_input_fails_its_own_request_naming_it(monkeypatch):
    """The guard reads each request's tensors on its own: a tensor the stub cannot deserialise
    raises InvalidInput for that request (400 naming the input), not an error for the batch."""
    import numpy as np

    from tritonguard.core.errors import InvalidInput
    from tritonguard.triton import backend as triton

    class Tensor:
        def __init__(self, arr):
            self.arr = arr

        def as_numpy(self):
            if self.arr is None:
                raise RuntimeError("incomplete string data")
            return self.arr

    class Pb:
        @staticmethod
        def get_input_tensor_by_name(request, name):
            return request.get(name)

    monkeypatch.setattr(triton, "pb", lambda: Pb)
    good = {"TEXT": Tensor(np.array([[b"hi"]], dtype=object))}
    assert triton.request_inputs(good, ["TEXT", "OPTIONAL"])["TEXT"][0, 0] == b"hi"
    with pytest.raises(InvalidInput) as err:
        triton.request_inputs({"TEXT": Tensor(None)}, ["TEXT"])
    assert err.value.code == "INVALID_ARG" and "'TEXT'" in str(err.value) and "readable" in str(err.value)
