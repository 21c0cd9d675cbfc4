"""The restart back-off both supervisors keep: doubling per restart, capped, reset after a
steady run."""

from shared.runtime.restarts import BackOff, RestartClock


def test_the_delay_doubles_to_its_cap_and_resets_after_a_steady_run():
    clock = RestartClock(BackOff(first_s=1.0, max_s=4.0, steady_s=60.0), started_at=0.0)
    now, delays = 0.0, []
    for _ in range(4):  # a crash loop: each exit right after its start
        now += 0.1
        delays.append(clock.exited(now))
        assert not clock.due(now)
        now += delays[-1]
        assert clock.due(now)
        clock.restarted(now)
    assert delays == [1.0, 2.0, 4.0, 4.0]
    assert clock.exited(now + 61.0) == 1.0  # it had stayed up a minute: a fresh failure
