"""lynx.runtime.core_pin: which CPU ranks get a core of their own, and that every thread of the
process (and a later one) lands there (in a child process, so this test's own keeps its CPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lynx.runtime.core_pin import pin_plan


def test_ranks_that_fill_the_cores_evenly_get_one_each_and_others_are_left_alone() -> None:
    two = [0, 1]
    # tp 2 on 2 cores: a core each, by local rank
    assert [pin_plan(r, 2, 2, two) for r in range(2)] == [0, 1]
    # pp 2 × tp 2 on 2 cores: each TP group (tp innermost) spread over both cores
    assert [pin_plan(r, 4, 2, two) for r in range(4)] == [0, 1, 0, 1]
    # the process may use only some CPUs (taskset): those, in order
    assert [pin_plan(r, 2, 2, [5, 3]) for r in range(2)] == [3, 5]
    # no TP (pp 2, pp 4 on 2 cores): the scheduler balances the busy ranks and other jobs'
    assert pin_plan(0, 2, 1, two) is None
    assert pin_plan(0, 4, 1, two) is None
    # fewer ranks than cores, an uneven count, one core: nothing to choose
    assert pin_plan(0, 2, 2, [0, 1, 2, 3]) is None
    assert pin_plan(0, 6, 2, [0, 1, 2, 3]) is None
    assert pin_plan(0, 2, 2, [0]) is None


_CHILD = """
import json, os, threading
os.environ.update(LOCAL_RANK="1", LOCAL_WORLD_SIZE=str(len(os.sched_getaffinity(0))))
early, done = [], threading.Event()
threading.Thread(target=lambda: early.append(threading.get_native_id()) or done.wait(60)).start()
while not early:
    pass
from lynx.runtime.core_pin import pin_rank
core = pin_rank(tp=2)
seen = []
t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
t.start(); t.join()
print(json.dumps({"core": core, "main": sorted(os.sched_getaffinity(0)),
                  "early": sorted(os.sched_getaffinity(early[0])), "later": seen[0]}))
done.set()
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs affinity control and two CPUs")
def test_every_thread_and_later_ones_are_pinned() -> None:
    got = json.loads(subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                                    check=True, timeout=60).stdout)
    core = sorted(os.sched_getaffinity(0))[1]
    assert got == {"core": core, "main": [core], "early": [core], "later": [core]}
