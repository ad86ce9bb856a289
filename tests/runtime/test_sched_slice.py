"""lynx.runtime.sched_slice: a CPU rank's threads on short scheduler slices (in a child process,
so this test's own process keeps its slices)."""

from __future__ import annotations

import json
import subprocess
import sys

from lynx.runtime.sched_slice import SHORT_SLICE_S, custom_slices, request_short_slices

_CHILD = """
import json, threading
from lynx.runtime.sched_slice import request_short_slices, thread_slice_s
before = thread_slice_s()
took = request_short_slices()
seen = []
t = threading.Thread(target=lambda: seen.append(thread_slice_s()))
t.start(); t.join()
print(json.dumps({"before": before, "took": took, "after": thread_slice_s(), "later_thread": seen[0]}))
"""


def test_every_thread_and_later_ones_get_the_short_slice() -> None:
    got = json.loads(subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                                    check=True, timeout=60).stdout)
    assert request_short_slices(threads=[]) == 0
    if sys.platform != "linux":
        assert got["took"] == 0
        return
    assert got["took"] >= 1
    if custom_slices() and got["before"] is not None:   # the kernel shows and grants them
        assert got["after"] == SHORT_SLICE_S and got["later_thread"] == SHORT_SLICE_S
