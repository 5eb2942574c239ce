"""perf.cost.price: CPU per request and the batched target's mean batch from two snapshots
(the snapshots themselves are read from a real server by ``make bench``)."""

from __future__ import annotations

import pytest

from perf.cost import Snapshot, price


def test_guarded_minilm_price_counts_the_guard_stubs_and_the_encoders_batches():
    before = Snapshot(cpu={"core": 10.0, "stub:guard": 1.0, "stub:intake": 0.5, "stub:tokenizer": 2.0, "stub:runtime": 5.0},
                      stats={"minilm": (100, 100, 60), "minilm_encoder": (20, 100, 25)})
    after = Snapshot(cpu={"core": 10.4, "stub:guard": 1.6, "stub:intake": 0.7, "stub:tokenizer": 2.5, "stub:runtime": 9.8},
                     stats={"minilm": (1100, 1100, 400), "minilm_encoder": (150, 1100, 150)})
    got = price(before, after, "minilm")
    assert got["requests"] == 1000
    assert got["cpu_ms_per_request"] == pytest.approx(6.5)  # 0.4 + 0.6 + 0.2 + 0.5 + 4.8 s over 1000
    assert got["guard_cpu_ms_per_request"] == pytest.approx(0.8)
    assert got["core_cpu_ms_per_request"] == pytest.approx(0.4)
    assert got["target_mean_batch"] == 8.0  # 1000 rows in 125 executions


def test_an_in_process_guard_batches_itself():
    before = Snapshot(cpu={"stub:guard": 1.0}, stats={"digits": (0, 0, 0), "digits_raw": (5, 5, 5)})
    after = Snapshot(cpu={"stub:guard": 1.3}, stats={"digits": (600, 600, 100), "digits_raw": (5, 5, 5)})
    got = price(before, after, "digits")
    assert got["target_mean_batch"] == 6.0
    assert got["guard_cpu_ms_per_request"] == pytest.approx(0.5)


def test_an_in_process_text_guard_batches_in_its_guard_step():
    # minilm with placement inprocess: the encoder model runs nothing, the public ensemble runs
    # one "execution" per request; the batches are those of the guard step, minilm_guard
    before = Snapshot(cpu={"stub:guard": 1.0}, stats={"minilm": (0, 0, 0), "minilm_guard": (0, 0, 0),
                                                      "minilm_encoder": (5, 5, 5)})
    after = Snapshot(cpu={"stub:guard": 9.0}, stats={"minilm": (900, 900, 900), "minilm_guard": (900, 900, 100),
                                                     "minilm_encoder": (5, 5, 5)})
    got = price(before, after, "minilm")
    assert got["target_mean_batch"] == 9.0
    assert got["guard_cpu_ms_per_request"] == pytest.approx(8000 / 900, abs=0.001)  # the encoder runs in it


def test_the_raw_path_is_read_under_its_own_name():
    before = Snapshot(cpu={"stub:runtime": 0.0}, stats={"digits_raw": (0, 0, 0)})
    after = Snapshot(cpu={"stub:runtime": 0.2}, stats={"digits_raw": (400, 400, 50)})
    got = price(before, after, "digits_raw")
    assert got["target_mean_batch"] == 8.0 and got["guard_cpu_ms_per_request"] == 0.0


def test_no_requests_gives_no_price_rather_than_a_division_by_zero():
    snap = Snapshot(cpu={"core": 1.0}, stats={"minilm": (5, 5, 5)})
    got = price(snap, snap, "minilm")
    assert got["requests"] == 0 and got["cpu_ms_per_request"] is None and got["target_mean_batch"] is None
