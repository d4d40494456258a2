"""A pytest plugin that writes each failure's report to a file the moment it is known.

On a lent GPU machine the suite may be stopped at the call's limit before pytest prints its
summary; this keeps every failure's reason anyway (`benchmarks/gpu_session.sh` loads it):

    FDP_FAILURES=$OUT/failures.txt python -m pytest -p benchmarks.failures_plugin ...
"""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    if not report.failed or not os.environ.get("FDP_FAILURES"):
        return
    with open(os.environ["FDP_FAILURES"], "a") as out:
        out.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n\n")
