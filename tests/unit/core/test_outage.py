"""The shared pause-after-failure rule (cache tiers, Redis state store, audit anchors)."""

from tritonguard.core.outage import Backoff


def test_pause_doubles_to_its_cap_and_a_success_resets_it():
    now = [100.0]
    b = Backoff(lambda: now[0], start_s=5.0, max_s=60.0)
    assert b.available() and not b.recover()
    assert b.fail() == 5.0 and not b.available()
    now[0] += 4.9
    assert not b.available()
    now[0] += 0.1
    assert b.available()  # time to try again; a new failure doubles the pause
    assert [b.fail() for _ in range(5)] == [10.0, 20.0, 40.0, 60.0, 60.0]
    assert b.recover() and b.backoff == 0.0 and b.available()
    assert b.fail() == 5.0  # a new outage starts from the beginning
