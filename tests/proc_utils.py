"""Process helpers for tests that start Flower's CLI processes: free ports and killing whole trees."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """pid and all its descendants, from /proc (SuperLink and SuperNodes spawn SuperExec,
    flwr-serverapp and flwr-clientapp processes, some in sessions of their own)."""
    children = _children()
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, []))
    return out


def pids_with_argument(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (e.g. a temporary FLWR_HOME)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry))
    return found


def kill_pids(pids: Iterable[int]) -> None:
    """SIGTERM, a grace period, then SIGKILL for every pid and its descendants."""
    pids = [p for pid in pids for p in descendants(pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGTERM:
            deadline = time.time() + 5
            while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
                time.sleep(0.2)


def kill_tree(procs: list[subprocess.Popen]) -> None:
    kill_pids(proc.pid for proc in procs)
    for proc in procs:
        proc.wait(timeout=10)


def wait_for_port(port: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")
