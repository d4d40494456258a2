"""fdp.comm: watched waits end with the collective's own outcome."""

import pytest

from fdp.comm import wait_watched


class _Work:
    """A collective as c10d's ``Work`` behaves: ``wait(timeout)`` raises "Operation timed out!" while not done,
    and ``wait()`` on finished work returns or raises the collective's own failure."""

    def __init__(self, polls_before_done: int, failure: str | None = None):
        self.polls_left, self.failure = polls_before_done, failure

    def is_completed(self) -> bool:
        return self.polls_left <= 0

    def wait(self, timeout=None):
        if not self.is_completed():
            self.polls_left -= 1  # it finishes while this poll gives up: the poll still says it timed out
            raise RuntimeError("Operation timed out!")
        if self.failure:
            raise RuntimeError(self.failure)
        return True


def test_a_collective_that_finishes_just_after_a_poll_times_out_is_done_not_failed():
    watched = []
    wait_watched(_Work(polls_before_done=3), lambda: watched.append(1))
    assert len(watched) == 2  # the world was asked about while the collective ran, never after it finished


def test_a_failed_collective_raises_its_own_failure_not_the_polls_timeout():
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_watched(_Work(polls_before_done=2, failure="Connection closed by peer"), lambda: None)


def test_the_watch_ends_a_wait_on_a_broken_world():
    def broken():
        raise RuntimeError("rank 2 reported a lost rank")

    with pytest.raises(RuntimeError, match="reported a lost rank"):
        wait_watched(_Work(polls_before_done=10), broken)
