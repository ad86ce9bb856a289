"""``hardware="auto"``: this host, measured once by ``lynx calibrate`` and kept in the user's cache.

The measurement lives in ``$LYNX_CACHE_DIR``, else ``$XDG_CACHE_HOME/lynx``, else the platform's
cache folder (``~/.cache/lynx`` on Linux, ``~/Library/Caches/lynx`` on macOS,
``%LOCALAPPDATA%\\lynx`` on Windows), one file per host, torch build and CPU: a file made on
another machine, or with another torch, is never picked up. The first ``auto`` without one
measures (about 20 s, with progress on stderr); ``lynx calibrate`` measures again and replaces
it. A cached file that no longer reads (an older format) is measured again too.

The measurement runs in a process of its own (``python -m lynx.calibrate``): it needs torch,
which planning from a file does not, and it must not touch the caller's random state, thread
settings or process group (``auto`` may be resolved inside a rank of a training job).

Example::

    >>> path = auto_path()                       # where this host's measurement is (or will be)
    >>> path.parent == cache_dir(), path.name.startswith("hardware-"), path.suffix
    (True, True, '.json')
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from lynx.errors import LynxConfigError
from lynx.planner.hardware import HardwareSpec

__all__ = ["cache_dir", "auto_path", "host_description", "auto_hardware"]


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
    """This host's measured spec: the cached file, or a new measurement (``refresh``: always)."""
    from lynx.planner.hardware_files import load_hardware_file

    path = auto_path()
    if path.is_file() and not refresh:
        try:
            return load_hardware_file(path)
        except LynxConfigError as err:
            print(f"lynx: the cached measurement {path} no longer reads ({err}); measuring again", file=sys.stderr)
    else:
        print(f"lynx: hardware 'auto': {'measuring' if refresh else 'no measurement of this host yet; measuring'} "
              f"it (lynx calibrate) into {path}", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
