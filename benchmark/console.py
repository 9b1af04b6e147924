"""The ``fedmjp`` command: one entry point for the project's command lines.

    fedmjp run [run_benchmark.py flags]             # = python run_benchmark.py ...
    fedmjp attack-captured OUT_DIR [flags]          # = python run_benchmark.py --from-captured OUT_DIR ...
    fedmjp check-server OUT_DIR [--strict]          # = python -m server.run --check OUT_DIR
    fedmjp train [fedmjp.train flags]               # = python -m fedmjp.train ...
    fedmjp stop-superlink                           # stop the SuperLink `flwr run` left running

``[project.scripts]`` in pyproject.toml installs it (``bash scripts/setup.sh``). This module imports
only the standard library: ``fedmjp --help`` answers at once, and each command imports its own
code (torch, Flower) when it runs. ``run`` and ``attack-captured`` run the checkout's
``run_benchmark.py`` (an editable install, as ``scripts/setup.sh`` makes).
"""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]

#: command -> (what it is, for --help)
COMMANDS = {
    "run": "the benchmark: federations -> attacks -> tables (python run_benchmark.py; fedmjp run --help)",
    "attack-captured": "attack the updates a flwr run or deployment tapped into OUT_DIR "
                       "(run_benchmark.py --from-captured OUT_DIR)",
    "check-server": "exit status of a finished server run in OUT_DIR (python -m server.run --check OUT_DIR)",
    "train": "train a model from a recipe (python -m fedmjp.train; fedmjp train --help)",
    "stop-superlink": "stop the local SuperLink that `flwr run` started and left running ($FLWR_HOME's)",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: fedmjp COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    lines += ["", "fedmjp COMMAND --help lists a command's own flags."]
    return "\n".join(lines)


def _run_benchmark_main() -> Callable[[Optional[Sequence[str]]], int]:
    """``main`` of the checkout's run_benchmark.py."""
    script = ROOT / "run_benchmark.py"
    if not script.is_file():
        raise SystemExit(f"error: {script} is missing: `fedmjp run` needs the project's checkout installed "
                         "editable (bash scripts/setup.sh)")
    spec = importlib.util.spec_from_file_location("run_benchmark", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_benchmark"] = module
    spec.loader.exec_module(module)
    return module.main


def _flwr_home() -> Path:
    """Flower's home folder, as flwr reads it (flwr.supercore.utils.get_flwr_home)."""
    home = os.environ.get("FLWR_HOME")
    return Path(home) if home else Path.home() / ".flwr"


def local_superlinks(flwr_home: Path) -> list[int]:
    """Process ids of the SuperLinks that `flwr run` started for ``flwr_home``: the
    ``flower-superlink`` processes whose ``--log-file`` is that home's
    ``local-superlink/superlink.log`` (flwr/cli/local_superlink.py starts it so, detached)."""
    log = str(flwr_home / "local-superlink" / "superlink.log")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if any(Path(a).name == "flower-superlink" for a in args[:2]) and any(
                a == "--log-file" and b == log for a, b in zip(args, args[1:])):
            found.append(int(entry))
    return found


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (the SuperLink's SuperExec and app processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, []))
    return out


def stop_superlink(argv: Sequence[str]) -> int:
    """Stop (SIGTERM, then SIGKILL after 10 s) the local SuperLinks of $FLWR_HOME and their processes."""
    if argv:
        print(f"usage: fedmjp stop-superlink (takes no arguments; it stops $FLWR_HOME's local SuperLink, "
              f"here {_flwr_home()}), got {' '.join(argv)}", file=sys.stderr)
        return 2
    if not Path("/proc").is_dir():
        print("error: fedmjp stop-superlink reads /proc (Linux); stop the flower-superlink process by its id",
              file=sys.stderr)
        return 1
    home = _flwr_home()
    pids = [p for pid in local_superlinks(home) for p in _descendants(pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        if not any(_alive(p) for p in pids):
            break
    print(f"stopped the local SuperLink of {home} ({len(pids)} process(es))" if pids
          else f"no local SuperLink of {home} is running")
    return 0


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, rest = args[0], args[1:]
    if command == "run":
        return _run_benchmark_main()(rest)
    if command == "attack-captured":
        if not rest or rest[0].startswith("-"):
            if rest and rest[0] in ("-h", "--help"):
                return _run_benchmark_main()(["--help"])
            print("usage: fedmjp attack-captured OUT_DIR [run_benchmark.py flags]: OUT_DIR is the out-dir of a "
                  "flwr run or deployment (e.g. runs/fl)", file=sys.stderr)
            return 2
        return _run_benchmark_main()(["--from-captured", rest[0], *rest[1:]])
    if command == "check-server":
        if not rest or rest[0].startswith("-"):
            print("usage: fedmjp check-server OUT_DIR [--strict]", file=sys.stderr)
            return 2
        from server.run import main as server_main

        return server_main(["--check", rest[0], *rest[1:]])
    if command == "train":
        from fedmjp.train import main as train_main

        return train_main(rest)
    if command == "stop-superlink":
        return stop_superlink(rest)
    print(f"fedmjp: unknown command {command!r}; valid: {', '.join(COMMANDS)} (fedmjp --help)", file=sys.stderr)
    return 2


def entry() -> None:
    """The ``fedmjp`` console script: :func:`main`, ended by :func:`fedmjp.threads.exit_process`."""
    code = main()
    threads = sys.modules.get("fedmjp.threads")  # not imported: no daemon thread was started (and --help stays light)
    if threads is None:
        sys.exit(code)
    threads.exit_process(code)


if __name__ == "__main__":
    entry()
