"""Running timed benchmarks on a machine other jobs share.

With the scheduler's autogroups (one per session, equal shares) a process's nice value only
ranks it within its own session, so a benchmark that wants the other sessions' jobs to disturb
it less lowers the niceness of its session's autogroup (root only; elsewhere nothing changes).
Where autogroups are off (``/proc/sys/kernel/sched_autogroup_enabled`` 0, as on the 2-vCPU
development VM) an autogroup's niceness is accepted but ranks nothing, so the process's own
niceness is set instead (its threads and children inherit it).

    >>> renice_session(0)  # 0: leave the niceness as it is
    False
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["renice_session"]


def renice_session(nice: int) -> bool:
    """Give this process's session (its autogroup) the niceness ``nice``; whether it took."""
    if not nice:
        return False
    try:
        if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "0":
            os.setpriority(os.PRIO_PROCESS, 0, nice)
            return True
    except OSError:
        pass
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
        return True
    except OSError:
        try:
            os.nice(nice)
            return True
        except PermissionError:
            return False
