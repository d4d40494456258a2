"""Which ranks are still alive: each beats a counter in a store every half second, from a thread.

A collective that fails says only that some peer is gone or late. The heartbeats tell a
rank that was killed, stopped or cut off (its counter stands still) from one that only
saw the failure too (``fdp.procs.shrink`` drops the first kind and goes on; a world that
does not shrink names it in its error).

>>> Heartbeat(0, 1, store=None).start().silent_ranks() is None  # no store: unknown
True
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from fdp._torch import default_store

__all__ = ["Heartbeat"]

_ASK_EVERY_S = 0.01


class Heartbeat:
    """Every rank bumps its counter in the process group's store every ``interval_s`` seconds.

    When a collective fails, ``silent_ranks()`` says which ranks stopped beating (killed,
    stopped or unreachable) as opposed to ranks that merely saw the failure too. The beat
    runs in a daemon thread, so a rank blocked in a collective still answers. Without a
    store to beat in (a torch that hides it), ``silent_ranks()`` is ``None``: unknown.
    """

    def __init__(self, rank: int, world_size: int, interval_s: float = 0.5, store: Any = None):
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self._store = store if store is not None else default_store()  # the default group's, unless given
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="fdp-heartbeat", daemon=True)

    @staticmethod
    def key(rank: int) -> str:
        """Rank ``rank``'s counter in the store."""
        return f"fdp/heartbeat/{rank}"

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self.key(self.rank), 1)
            except Exception:  # the store is gone: nothing left to tell
                return
            self._stop.wait(self.interval_s)

    def start(self) -> "Heartbeat":
        if self._store is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        """End the beat and wait for it: a beat still in the store when the group is destroyed would outlive it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 5.0)

    def _counts(self) -> list[int]:
        return [self._store.add(self.key(r), 0) for r in range(self.world_size)]

    def silent_ranks(self, known: Callable[[], list[int]] = list) -> list[int] | None:
        """Ranks whose counter did not move over three beats (``None``: the store does not answer).

        ``known()``, asked every 10 ms meanwhile, names ranks known lost another way (their keepers saw
        them die, ``fdp.procs.shrink``): once it names any, they are the answer, without the beats.
        """
        if self._store is None:
            return None
        try:
            before, deadline = self._counts(), time.monotonic() + 3 * self.interval_s
            while time.monotonic() < deadline:
                if lost := known():
                    return lost
                time.sleep(_ASK_EVERY_S)
            after = self._counts()
        except Exception:
            return None
        return [r for r, (a, b) in enumerate(zip(before, after)) if a == b and r != self.rank]
