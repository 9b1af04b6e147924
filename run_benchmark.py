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
from typing import Optional, Sequence

from tqdm.contrib.logging import logging_redirect_tqdm

from benchmark.cli import setup_logging, build_parser, default_output, resolve
from benchmark.config import PROJECT_ROOT, BenchmarkConfig
from benchmark.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, BenchmarkError, ConfigError, OutputWriteError
from fedmjp.allocator import tune_malloc
from server.offline import keep_flower_offline


def _print_trained(jobs: list) -> None:
    print(f"trained: {', '.join(job.row for job in jobs) or 'nothing (all checkpoints finished)'}")


#: Errors of a write into the output folder: exit status 10 with one line (rows are kept).
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                 errno.EISDIR, errno.EEXIST, errno.ELOOP, errno.ENAMETOOLONG}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: unwinds like Ctrl-C (finished rows kept, workers stopped)."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


def parser() -> argparse.ArgumentParser:
    """The CLI's flags (:func:`benchmark.cli.build_parser`) and this script's ``--force``."""
    p = build_parser()
    p.add_argument("--force", action="store_true",
                   help="write into an existing non-empty --output folder that is not a run folder (no "
                        "config.yaml): files of the names a run writes there (table.csv, grid_c.png, ...) are "
                        "replaced. Without it such a folder is refused (exit 6); a folder holding symbolic links "
                        "where a run writes is refused either way")
    return p


def output_folder(args: argparse.Namespace, cfg: BenchmarkConfig) -> Path:
    """``--output`` (relative to the working directory), else the config's ``output:`` (relative to
    the project root, like every path in a config file), else ``runs/<time>-setting-<s>``."""
    # made absolute without resolving links: an output folder that is a symbolic link is refused
    # (benchmark/store.py), never followed
    if args.output:
        return Path(os.path.abspath(Path(args.output).expanduser()))
    if cfg.output:
        return Path(os.path.abspath(PROJECT_ROOT / Path(str(cfg.output)).expanduser()))
    return Path(default_output(cfg))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit status (see :mod:`benchmark.errors`)."""
    args = parser().parse_args(argv)
    setup_logging(args.verbose)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _main(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> int:
    if args.list:  # attacks, defences, models: built-ins and installed plug-ins
        from benchmark.cli import catalog_text

        print(catalog_text())
        return 0
    keep_flower_offline()  # before anything imports flwr
    tune_malloc()  # freed tensors' memory is reused instead of faulted in again (fedmjp/allocator.py)
    t0 = time.perf_counter()
    output = None
    try:
        cfg = resolve(args)
        output = str(output_folder(args, cfg))
        cfg.output = output
        from benchmark.pipeline import raise_for_errors, run_benchmark
        from benchmark.training import train_missing

        if cfg.sweep:
            from benchmark.sweep import run_sweep

            with logging_redirect_tqdm():
                if args.train_missing:  # every point attacks the same checkpoints: train them once, first
                    _print_trained(train_missing(cfg, progress=not args.no_progress))
                swept = run_sweep(cfg, output, progress=not args.no_progress)
            print(Path(swept["csv"]).read_text())
            print(f"output: {swept['folder']} (results.jsonl with a sweep column, sweep.csv, "
                  f"{', '.join(Path(p).name for p in swept['plots'])}; one run folder per point under points/)")
            return 0
        with logging_redirect_tqdm():  # log lines above the progress bars, not through them
            if args.train_missing:
                from benchmark.store import RunFolder

                RunFolder(output, force=args.force).check(cfg)  # a conflicting folder fails before any training
                _print_trained(train_missing(cfg, progress=not args.no_progress))
            summary = run_benchmark(cfg, output, progress=not args.no_progress, force=args.force)
    except (BenchmarkError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
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
    print(f"output: {summary.folder} (results.jsonl, table.csv/.md/.tex, table_full.csv, "
          f"{', '.join(Path(g).name for g in summary.grids) or 'no grid'}, config.yaml)")
    print(f"wall time: {time.perf_counter() - t0:.1f} s")
    try:
        raise_for_errors(summary)  # tables are written; a bug in an attack still fails the run
    except BenchmarkError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
