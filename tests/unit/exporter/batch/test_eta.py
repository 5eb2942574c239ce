"""exporter.batch.eta: no ETA until it rests on enough progress (issue 45 item 6: the first
figure of a 13-second job read 18 minutes). A clock the test moves; nothing is timed."""

from __future__ import annotations

import pytest

from exporter.batch.eta import MIN_RATE_S, Eta, eta_text


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_no_eta_from_the_first_few_rows_and_start_up_does_not_count():
    clock = Clock()
    eta = Eta(50_000, clock=clock)
    clock.t += 9.0  # Ray starting: nothing answered
    assert eta.update(0) is None
    assert eta.update(64) is None  # the first answers: no rate yet
    clock.t += 0.5
    assert eta.update(200) is None and eta.rate == pytest.approx(272)  # 0.4 % after 0.5 s: too little
    # the old figure (rows over the time since start, Ray's start-up included) read ~37 minutes here
    clock.t += 0.5
    assert eta.update(2_600) is not None  # 5.2 %: now it rests on something
    assert eta.rate == pytest.approx((2_600 - 64) / 1.0)
    assert eta.left == pytest.approx((50_000 - 2_600) / eta.rate)


def test_a_slow_job_gets_an_eta_after_some_seconds_of_answers():
    clock = Clock()
    eta = Eta(1_000_000, clock=clock)
    eta.update(100)
    clock.t += MIN_RATE_S - 0.5
    assert eta.update(1_000) is None
    clock.t += 0.5
    assert eta.update(1_300) == pytest.approx((1_000_000 - 1_300) / (1_200 / MIN_RATE_S))


def test_done_and_text():
    clock = Clock()
    eta = Eta(10, clock=clock)
    eta.update(5)
    clock.t += 1
    assert eta.update(10) == 0.0
    assert eta_text(None) == "-:--:--" and eta_text(13.4) == "0:00:13" and eta_text(3_725) == "1:02:05"
