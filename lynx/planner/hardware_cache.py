"""``hardware="auto"``: this host, measured once by ``lynx calibrate`` and kept in the user's cache.

The measurement lives in ``$LYNX_CACHE_DIR``, else ``$XDG_CACHE_HOME/lynx``, else the platform's
cache folder (``~/.cache/lynx`` on Linux, ``~/Library/Caches/lynx`` on macOS,
``%LOCALAPPDATA%\\lynx`` on Windows), one file per host, torch build and CPU: a file made on
another machine, or with another torch, is never picked up. The first ``auto`` without one
measures (about 20 s, with progress on stderr); ``lynx calibrate`` measures again and replaces
it; the ranks of a job that all ask at once wait for one measurement (a lock file beside it).
A cached file that no longer reads (an older format) is measured again too, and so is one
older than :data:`MAX_AGE_DAYS` or made while the machine was much busier than it is now
(:func:`stale_reason`: its 1-minute load average, the lower of before and after, above
the present one by more than :data:`LOAD_MARGIN_PER_CPU` per cpu) — a quieter machine measures
more steadily. A machine busier now than when measured keeps the quieter measurement (one
made now would only be noisier); the run summary compares the two loads. Each case is said on
stderr.

The measurement runs in a process of its own (``python -m lynx.calibrate``): it needs torch,
which planning from a file does not, and it must not touch the caller's random state, thread
settings or process group (``auto`` may be resolved inside a rank of a training job).

Example::

    >>> path = auto_path()                       # where this host's measurement is (or will be)
    >>> path.parent == cache_dir(), path.name.startswith("hardware-"), path.suffix
    (True, True, '.json')
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from lynx.errors import LynxConfigError
from lynx.planner.hardware import CALIBRATION_METHOD, Calibration, HardwareSpec

__all__ = ["cache_dir", "auto_path", "host_description", "auto_hardware", "stale_reason", "MAX_AGE_DAYS",
           "LOAD_MARGIN_PER_CPU"]

MAX_AGE_DAYS = 7            # a measurement older than this is taken again (the host may have changed)
LOAD_MARGIN_PER_CPU = 1.0   # runnable processes per cpu: "a very different load" for auto and the run summary


def cache_dir() -> Path:
    """The folder Lynx caches this user's measurements in."""
    if os.environ.get("LYNX_CACHE_DIR"):
        return Path(os.environ["LYNX_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "lynx"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "lynx"
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "lynx"
    return Path.home() / ".cache" / "lynx"


def host_description() -> str:
    """What a measurement is valid for: host name, CPU model and count, torch build."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    return f"{socket.gethostname()} | {_cpu_model()} | {os.cpu_count()} cpus | torch {torch_version}"


def auto_path() -> Path:
    """This host's cached hardware file (it may not exist yet)."""
    digest = hashlib.sha256(host_description().encode()).hexdigest()[:12]
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40] or "host"
    return cache_dir() / f"hardware-{host}-{digest}.json"


def auto_hardware(refresh: bool = False) -> HardwareSpec:
    """This host's measured spec: the cached file, or a new measurement (``refresh``: always).

    One measurement at a time per host: the ranks of a job that all resolve ``auto`` wait for
    the first one's and read it."""
    from lynx.planner.hardware_files import load_hardware_file

    path = auto_path()
    spec, why = (None, "measuring it") if refresh else _cached(path)
    if spec is not None:
        return spec
    path.parent.mkdir(parents=True, exist_ok=True)
    asked = time.time()
    with _measuring(path):
        if not refresh and path.is_file() and path.stat().st_mtime >= asked:
            return load_hardware_file(path)  # measured by another process while this one waited
        print(f"lynx: hardware 'auto': {why}; measuring (lynx calibrate) into {path}", file=sys.stderr)
        command = [sys.executable, "-m", "lynx.calibrate", "--output", str(path)]
        try:
            done = subprocess.run(command, timeout=600)
        except subprocess.TimeoutExpired:
            raise LynxConfigError(
                f"measuring this machine for hardware 'auto' took over 10 minutes: {' '.join(command)}"
            ) from None
    if done.returncode != 0 or not path.is_file():
        raise LynxConfigError(
            f"measuring this machine for hardware 'auto' failed (exit {done.returncode}; its output is above): "
            f"run `lynx calibrate` to see why, or pass a preset or a hardware file instead"
        )
    return load_hardware_file(path)


def _cached(path: Path) -> tuple[HardwareSpec | None, str]:
    """The cached spec if it is to be used now, else None and why it is not."""
    from lynx.planner.hardware_files import load_hardware_file

    if not path.is_file():
        return None, "no measurement of this host yet"
    try:
        spec = load_hardware_file(path)
    except LynxConfigError as err:
        return None, f"the cached measurement {path} no longer reads ({err})"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    why = stale_reason(spec.calibration, load, os.cpu_count() or 1)
    if why is not None:
        return None, why
    busier = _busier_note(spec.calibration, load, os.cpu_count() or 1)
    if busier:
        print(f"lynx: hardware 'auto': {busier}", file=sys.stderr)
    return spec, ""


@contextlib.contextmanager
def _measuring(path: Path) -> Iterator[None]:
    """Hold this host's measurement lock (a lock file beside the cache file; none on Windows)."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here; concurrent measurements only cost time
        yield
        return
    with open(path.with_name(f".{path.name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def stale_reason(calibration: Calibration | None, load: float | None, cpus: int,
                 now: datetime.datetime | None = None) -> str | None:
    """Why a cached measurement should be taken again now, or None to use it.

    Made by an older method (:data:`lynx.planner.hardware.CALIBRATION_METHOD`), older than
    :data:`MAX_AGE_DAYS`, or made at a 1-minute load average (the lower of before and after)
    more than ``LOAD_MARGIN_PER_CPU × cpus`` above ``load``, the present one.

    Example::

        >>> from lynx.planner.hardware import Calibration
        >>> cal = Calibration(host="h", date="2026-01-01T00:00:00+00:00", seconds=10, repeats=5, threads=1,
        ...                   cpus=2, load_before=5.0, load_after=6.0, torch="2")
        >>> now = datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc)
        >>> stale_reason(cal, load=0.5, cpus=2, now=now)
        'the cached measurement was made at load 5.00 and the load is 0.50 now (beyond the margin of 2.0 on 2 cpus)'
        >>> stale_reason(cal, load=4.5, cpus=2, now=now) is None
        True
        >>> stale_reason(cal, load=4.5, cpus=2, now=now + datetime.timedelta(days=8))
        'the cached measurement is 9 days old (measured again after 7)'
        >>> stale_reason(cal.model_copy(update={"method": 1}), load=4.5, cpus=2, now=now)
        'the cached measurement was made by an older `lynx calibrate` (method 1; this Lynx measures by method 10)'
    """
    if calibration is None:
        return None  # a file written by hand into the cache: used as it is
    now = now or datetime.datetime.now(datetime.timezone.utc)
    try:
        made = datetime.datetime.fromisoformat(calibration.date)
        if made.tzinfo is None:
            made = made.replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        return f"the cached measurement's date {calibration.date!r} does not read"
    if calibration.method < CALIBRATION_METHOD:
        return (f"the cached measurement was made by an older `lynx calibrate` (method {calibration.method}; this "
                f"Lynx measures by method {CALIBRATION_METHOD})")
    age = now - made
    if age > datetime.timedelta(days=MAX_AGE_DAYS):
        return f"the cached measurement is {age.days} days old (measured again after {MAX_AGE_DAYS})"
    made_at = min(calibration.load_before, calibration.load_after)
    margin = LOAD_MARGIN_PER_CPU * cpus
    if load is not None and made_at - load > margin:
        return (f"the cached measurement was made at load {made_at:.2f} and the load is {load:.2f} now (beyond the "
                f"margin of {margin:.1f} on {cpus} cpus)")
    return None


def _busier_note(calibration: Calibration | None, load: float | None, cpus: int) -> str | None:
    if calibration is None or load is None:
        return None
    made_at = max(calibration.load_before, calibration.load_after)
    if load - made_at <= LOAD_MARGIN_PER_CPU * cpus:
        return None
    return (f"the load is {load:.2f} now, {made_at:.2f} when this machine was measured ({calibration.date}): "
            f"keeping that quieter measurement (one taken now would be noisier); the prediction is for it")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
