"""Tests of lynx.testbed: namespaces made and always removed, gloo over the links, rate limits,
failures named, loopback fallback. Namespace tests need root and iproute2 and skip otherwise."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from lynx.errors import LynxConfigError
from lynx.testbed import LynxTestbedError, NetBed, cleanup_stale, measure_link
from lynx.testbed.netns import NamespaceError
from test_doctests import TESTBED, run_docstring_examples  # pytest puts tests/ on sys.path (no package)

_CAN_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
needs_netns = pytest.mark.skipif(
    not _CAN_NETNS, reason="network namespaces need root and iproute2 (`ip`, `tc`)")

ALLREDUCE = r"""
import os, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
x = torch.full((262144,), float(dist.get_rank() + 1))  # (262144,) fp32 = 1 MiB
dist.all_reduce(x)
ifname = os.environ["GLOO_SOCKET_IFNAME"]
tx = open(f"/sys/class/net/{ifname}/statistics/tx_bytes").read().strip()
print(f"sum={x[0].item()} tx={tx} addr={os.environ['MASTER_ADDR']}")
dist.destroy_process_group()
"""


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _pids_in(ns: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@needs_netns
def test_namespaces_made_limited_and_removed() -> None:
    with NetBed(world_size=3, rate_mbit=100.0) as bed:
        names = bed.namespaces
        assert bed.rate_limited and bed.uses_namespaces and len(names) == 4
        assert set(names) <= _netns()
        assert bed.addresses == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
        qdisc = subprocess.run(["tc", "-n", names[0], "qdisc", "show", "dev", "lynx0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        # No route out of the namespace: only the bed's own /24.
        routes = subprocess.run(["ip", "-n", names[0], "route"], capture_output=True,
                                text=True).stdout
        assert "default" not in routes and "10.213.0.0/24" in routes
    assert not set(names) & _netns()
    assert bed.namespaces == [] and not bed.rate_limited


@needs_netns
def test_gloo_allreduce_runs_over_the_namespace_link(tmp_path) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    with NetBed(world_size=2, rate_mbit=1000.0) as bed:
        results = bed.run([sys.executable, str(script)], timeout_s=60)
    for r in results:
        fields = dict(kv.split("=") for kv in r.stdout.split())
        assert r.returncode == 0 and float(fields["sum"]) == 3.0
        assert fields["addr"] == "10.213.0.1"
        # The 1 MiB all-reduce went out through the rate-limited veth, not loopback.
        assert int(fields["tx"]) > 500_000


@needs_netns
def test_rate_limited_link_is_slower_and_near_its_rate() -> None:
    nbytes = 2_000_000
    with NetBed(world_size=2, rate_mbit=10.0) as slow_bed:
        slow = measure_link(slow_bed, nbytes=nbytes, repeats=1)
    with NetBed(world_size=2, rate_mbit=1000.0) as fast_bed:
        fast = measure_link(fast_bed, nbytes=nbytes, repeats=1)
    assert slow.median_s >= 3 * fast.median_s, (slow, fast)
    # tbf never lets more than rate + one burst (~66 KB) through.
    assert slow.measured_mbit <= 10.0 * 1.1, slow
    assert slow.measured_mbit >= 10.0 * 0.5, slow


@needs_netns
def test_failing_rank_is_named_and_nothing_is_left() -> None:
    # Rank 1 fails; rank 0 spawned a grandchild, ranks 0 and 2 would sleep for minutes.
    code = ("import os, subprocess, sys, time\n"
            "r = int(os.environ['RANK'])\n"
            "if r == 0: print(subprocess.Popen(['sleep', '300']).pid, flush=True)\n"
            "time.sleep(0.5)\n"
            "if r == 1: sys.exit('boom from the test')\n"
            "time.sleep(300)\n")
    start = time.monotonic()
    with NetBed(world_size=3, rate_mbit=100.0) as bed:
        names = bed.namespaces
        with pytest.raises(LynxTestbedError, match=r"(?s)rank 1 failed.*boom from the test") as info:
            bed.run([sys.executable, "-c", code], timeout_s=60)
        assert all(_pids_in(ns) == [] for ns in names)
    assert time.monotonic() - start < 20
    err = info.value
    assert err.failed_rank == 1
    assert [r.killed_by_bed for r in err.results] == [True, False, True]
    grandchild = int(err.results[0].stdout.split()[0])
    assert not _alive(grandchild)
    assert not set(names) & _netns()


@needs_netns
def test_timeout_kills_all_ranks() -> None:
    with NetBed(world_size=2, rate_mbit=None) as bed:
        assert bed.uses_namespaces and not bed.rate_limited
        with pytest.raises(LynxTestbedError, match=r"(?s)timed out.*\[0, 1\]") as info:
            bed.run([sys.executable, "-c", "import time; time.sleep(300)"], timeout_s=1.0)
        assert all(r.killed_by_bed and r.returncode < 0 for r in info.value.results)
        assert all(_pids_in(ns) == [] for ns in bed.namespaces)


@needs_netns
def test_owner_killed_leaves_stale_namespaces_that_cleanup_removes() -> None:
    code = ("import sys, time\nfrom lynx.testbed import NetBed\n"
            "bed = NetBed(world_size=2, rate_mbit=10.0, mode='netns')\n"
            "print(' '.join(bed.namespaces), flush=True)\n"
            "time.sleep(300 if sys.argv[1] == 'hang' else 0)\n")
    # Normal exit without close(): the atexit hook removes them.
    out = subprocess.run([sys.executable, "-c", code, "exit"], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert len(out) == 3 and not set(out) & _netns()
    # SIGKILL: nothing runs in the owner, so they stay until cleanup_stale().
    proc = subprocess.Popen([sys.executable, "-c", code, "hang"], stdout=subprocess.PIPE,
                            text=True)
    names = proc.stdout.readline().split()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert len(names) == 3 and set(names) <= _netns()
    cleanup_stale()  # (another process's new bed may have removed them first: check the result)
    assert not set(names) & _netns()
    with NetBed(world_size=1, rate_mbit=None) as live:
        assert cleanup_stale() == []
        assert set(live.namespaces) <= _netns()  # a live bed's namespaces are untouched
    assert not set(names) & _netns()


def test_fallback_to_loopback_when_namespaces_cannot_be_made(tmp_path, caplog) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE.replace("tx = open", "tx = '0' or open"))
    with caplog.at_level(logging.WARNING, logger="lynx.testbed"):
        bed = NetBed(world_size=2, rate_mbit=10.0, ip="/nonexistent/ip")
    with bed:
        assert not bed.rate_limited and not bed.uses_namespaces and bed.namespaces == []
        assert bed.fallback_reason
        assert "falling back to loopback" in caplog.text
        results = bed.run([sys.executable, str(script)], timeout_s=60)
    for r in results:
        assert "sum=3.0" in r.stdout and "addr=127.0.0.1" in r.stdout


def test_netns_mode_refuses_to_fall_back() -> None:
    with pytest.raises(NamespaceError):
        NetBed(world_size=2, rate_mbit=10.0, mode="netns", ip="/nonexistent/ip")


def test_loopback_mode_reports_failures_too() -> None:
    with NetBed(world_size=2, mode="loopback") as bed:
        assert not bed.rate_limited and bed.fallback_reason == "mode='loopback' requested"
        # Rank 1 succeeds at once; rank 0 fails later (so rank 1 is not killed by the bed).
        code = ("import os, sys, time\n"
                "if os.environ['RANK'] == '0': time.sleep(1.0); sys.exit(7)\n")
        with pytest.raises(LynxTestbedError, match="rank 0 failed with exit code 7"):
            bed.run([sys.executable, "-c", code], timeout_s=30)
        results = bed.run([sys.executable, "-c", code], timeout_s=30, check=False)
        assert [r.returncode for r in results] == [7, 0]
        assert not any(r.killed_by_bed for r in results)
        # A per-rank command: a callable rank -> argv.
        results = bed.run(lambda k: [sys.executable, "-c", f"print({k} * 10)"], timeout_s=30)
        assert [r.stdout.strip() for r in results] == ["0", "10"]


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 0}, "world_size"),
    ({"world_size": 2, "rate_mbit": -1.0}, "rate_mbit"),
    ({"world_size": 2, "mode": "tunnel"}, "mode"),
])
def test_bad_settings_are_refused(kwargs, match) -> None:
    with pytest.raises(LynxConfigError, match=match):
        NetBed(**kwargs)


def test_not_root_falls_back_with_the_reason(monkeypatch) -> None:
    monkeypatch.setattr("lynx.testbed.netbed.os.geteuid", lambda: 1000)
    with NetBed(world_size=2, rate_mbit=10.0) as bed:
        assert not bed.rate_limited and "not running as root" in bed.fallback_reason
        assert bed.addresses == ["127.0.0.1", "127.0.0.1"] and bed.ifname == "lo"
        assert bed.exec_prefix(1) == []


def test_link_host_probe_sends_as_a_pipeline_unless_streamed() -> None:
    """``measure_link_host`` runs the probe with one message each way at a time (``--streamed``
    only when asked) and reads each rank's extra seconds per byte; the figure is their mean."""
    import json

    from lynx.testbed.host_probe import MARKER, measure_link_host
    from lynx.testbed.netbed import RankResult

    class Bed:
        world_size = 2

        def __init__(self) -> None:
            self.commands: list[list[str]] = []

        def run(self, command, env=None, timeout_s=None):
            self.commands.append(list(command))
            rows = [{"rank": r, "idle_s": [1.0, 1.0], "busy_s": [1.0 + 0.1 * (r + 1)] * 2, "bytes": 10**8}
                    for r in (0, 1)]
            return [RankResult(rank=r["rank"], returncode=0, stdout=MARKER + json.dumps(r) + "\n", stderr="",
                               elapsed_s=1.0) for r in rows]

    bed = Bed()
    paced = measure_link_host(bed, message_bytes=4096)
    measure_link_host(bed, message_bytes=4096, streamed=True)
    assert "--streamed" not in bed.commands[0] and bed.commands[1][-1] == "--streamed"
    assert paced.host_s_per_byte == pytest.approx((1e-9 + 2e-9) / 2)   # 0.1 s and 0.2 s over 1e8 B


@pytest.mark.parametrize("name", TESTBED)
def test_docstring_examples_run(name: str) -> None:
    """lynx.testbed's docstring examples (tests/test_doctests.py leaves them here: see TESTBED)."""
    run_docstring_examples(name)
