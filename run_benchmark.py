#!/usr/bin/env python3
"""Privacy benchmark: federated rounds -> gradient-inversion attacks -> metrics -> tables and grids.

    python run_benchmark.py --setting c                      # quick preset, embedded images, < 1 min on CPU
    python run_benchmark.py --config configs/paper.yaml --setting all   # the paper's protocol (GPU)

Flags and outputs: ``python run_benchmark.py --help`` and docs/benchmark.md. The work lives in
:mod:`benchmark`; this script parses, runs, and prints the table and where the outputs are.
"""
from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from benchmark.cli import setup_logging, build_parser, default_output, resolve

if TYPE_CHECKING:
    from benchmark.config import BenchmarkConfig

# The model code (torch, timm), Flower and matplotlib are imported after the flags are parsed and
# the config is checked: --help and a config error answer without them.


def _print_trained(jobs: list) -> None:
    print(f"trained: {', '.join(job.row for job in jobs) or 'nothing (all checkpoints finished)'}")


#: Errors of a write into the output folder: exit status 10 with one line (rows are kept).
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                 errno.EISDIR, errno.EEXIST, errno.ELOOP, errno.ENAMETOOLONG}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: unwinds like Ctrl-C (finished rows kept, workers stopped)."""


class _SignalHandler:
    """The CLI's SIGINT or SIGTERM handler: notes that the user's signal arrived (``received``), then
    raises ``KeyboardInterrupt`` (SIGINT) or :class:`Terminated` (SIGTERM). A plug-in's own
    ``KeyboardInterrupt`` comes with no signal received: fedmjp.plugins.interrupted_by_user tells
    the two apart by these attributes."""

    records_signals = True

    def __init__(self, error: type[KeyboardInterrupt]) -> None:
        self.error, self.received = error, None

    def __call__(self, signum: int, frame: object) -> None:
        self.received = signum
        raise self.error()


def parser() -> argparse.ArgumentParser:
    """The CLI's flags (:func:`benchmark.cli.build_parser`) and this script's ``--force``."""
    p = build_parser()
    p.add_argument("--force", action="store_true",
                   help="write into an existing non-empty --output folder that is not a run folder (no "
                        "config.yaml): files of the names a run writes there (table.csv, grid_c.png, ...) are "
                        "replaced. Without it such a folder is refused (exit 6); a folder holding symbolic links "
                        "where a run writes is refused either way")
    p.add_argument("--from-captured", metavar="OUT_DIR",
                   help="attack the updates a flwr run or deployment tapped into OUT_DIR (its out-dir) instead of "
                        "running a federation: its model, rounds, clients and images come from the capture "
                        "(benchmark/captured.py); --setting, --attack, --device, --set choose the rest")
    return p


def output_folder(args: argparse.Namespace, cfg: BenchmarkConfig) -> Path:
    """``--output`` (relative to the working directory), else the config's ``output:`` (relative to
    the project root, like every path in a config file), else ``runs/<time>-setting-<s>``."""
    # made absolute without resolving links: an output folder that is a symbolic link is refused
    # (benchmark/store.py), never followed
    from benchmark.config import PROJECT_ROOT

    if args.output:
        return Path(os.path.abspath(Path(args.output).expanduser()))
    if cfg.output:
        return Path(os.path.abspath(PROJECT_ROOT / Path(str(cfg.output)).expanduser()))
    return Path(default_output(cfg))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit status (see :mod:`benchmark.errors`)."""
    args = parser().parse_args(argv)
    setup_logging(args.verbose)
    previous: dict = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _SignalHandler(Terminated)),
                    signal.SIGINT: signal.signal(signal.SIGINT, _SignalHandler(KeyboardInterrupt))}
    try:
        return _main(args)
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(signum, handler)


def _main(args: argparse.Namespace) -> int:
    from benchmark.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, BenchmarkError, ConfigError, OutputWriteError
    from fedmjp.allocator import tune_malloc
    from fedmjp.text import printable
    from server.offline import keep_flower_offline

    if args.list:  # model rows of the config, attacks with their threat models, defences, architectures
        from benchmark.cli import catalog_text

        try:
            print(catalog_text(resolve(args)))
        except (BenchmarkError, ConfigError) as err:
            print(f"error: {printable(err)}", file=sys.stderr)
            return err.exit_code
        return 0
    keep_flower_offline()  # before anything imports flwr
    tune_malloc()  # freed tensors' memory is reused instead of faulted in again (fedmjp/allocator.py)
    t0 = time.perf_counter()
    output = None
    try:
        federate = None  # None: run_benchmark runs the federations itself
        if args.from_captured:  # the updates a flwr run or deployment tapped (benchmark/captured.py)
            from benchmark.captured import from_captured

            cfg, federate = from_captured(args)
        else:
            cfg = resolve(args)
        if not args.train_missing:  # rows not trained yet are left out, each with a note
            from benchmark.training import leave_out_untrained

            for note in leave_out_untrained(cfg):
                print(f"note: {note}", file=sys.stderr)
        from benchmark.estimate import plan_text

        print(plan_text(cfg))  # attacks planned and their estimated time, before any work
        if args.estimate:
            return 0
        output = str(output_folder(args, cfg))
        cfg.output = output
        from tqdm.contrib.logging import logging_redirect_tqdm
        from benchmark.pipeline import raise_for_errors, run_benchmark
        from benchmark.training import train_missing

        if cfg.sweep:
            from benchmark.sweep import run_sweep

            with logging_redirect_tqdm():
                if args.train_missing:  # every point attacks the same checkpoints: train them once, first
                    _print_trained(train_missing(cfg, progress=not args.no_progress))
                swept = run_sweep(cfg, output, progress=not args.no_progress, force=args.force)
            import pandas as pd

            from benchmark.sweep_table import sweep_table_text

            print(sweep_table_text(pd.read_csv(swept["csv"])))  # sweep.csv, aligned and rounded
            print(f"output: {swept['folder']} (results.jsonl with a sweep column, sweep.csv, "
                  f"{', '.join(Path(p).name for p in swept['plots'])}; one run folder per point under points/)")
            print(f"report: {Path(swept['folder']) / 'report.html'} (open it in a browser)")
            for point in swept["summaries"]:  # every point's tables are written; a failed point fails the sweep
                raise_for_errors(point)
            return 0
        with logging_redirect_tqdm():  # log lines above the progress bars, not through them
            if args.train_missing:
                from benchmark.store import RunFolder

                RunFolder(output, force=args.force).check(cfg)  # a conflicting folder fails before any training
                _print_trained(train_missing(cfg, progress=not args.no_progress))
            summary = run_benchmark(cfg, output, progress=not args.no_progress, force=args.force, federate=federate)
    except (BenchmarkError, ConfigError) as err:
        print(f"error: {printable(err)}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt as err:
        what = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
        if output:
            print(f"\n{what}: finished rows are kept in {output}; run the same command with --output {output} "
                  "to resume", file=sys.stderr)
        else:
            print(f"\n{what} before the output folder was chosen: nothing was written", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(err, Terminated) else EXIT_INTERRUPTED
    except OSError as err:
        # a write of the tables or grids (pandas, matplotlib) into the output folder that failed
        # (the store's own writes raise OutputWriteError); any other OSError is a bug: traceback
        if err.errno not in _WRITE_ERRNOS or output is None:
            raise
        from benchmark.files import write_error

        print(f"error: {write_error(Path(err.filename or output), err)}", file=sys.stderr)
        return OutputWriteError.exit_code
    print()
    print((Path(summary.folder) / "table.md").read_text())
    print(f"rows: {summary.new_rows} new, {summary.kept_rows} kept from an earlier run, {summary.failed_rows} failed; "
          f"federations run: {summary.federations}")
    print(f"report: {Path(summary.folder) / 'report.html'} (open it in a browser)")
    print(f"output: {summary.folder} (results.jsonl, table.csv/.md/.tex, table_full.csv, "
          f"{', '.join(Path(g).name for g in summary.grids) or 'no grid'}, config.yaml)")
    print(f"wall time: {time.perf_counter() - t0:.1f} s")
    try:
        raise_for_errors(summary)  # tables are written; a bug in an attack still fails the run
    except BenchmarkError as err:
        print(f"error: {printable(err)}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    from fedmjp.threads import exit_process

    exit_process(main())  # not sys.exit: a client or attack thread still running must not abort the exit
