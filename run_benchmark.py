#!/usr/bin/env python3
"""Privacy benchmark: federated rounds -> gradient-inversion attacks -> metrics -> tables and grids.

    python run_benchmark.py --setting c                      # quick preset, embedded images, < 5 min on CPU
    python run_benchmark.py --config configs/paper.yaml --setting all   # the paper's protocol (GPU)

Flags and outputs: ``python run_benchmark.py --help`` and README.md. The work lives in
:mod:`benchmark`; this script parses, runs, and prints the table and where the outputs are.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from tqdm.contrib.logging import logging_redirect_tqdm

from benchmark.cli import setup_logging, build_parser, default_output, resolve
from benchmark.errors import EXIT_INTERRUPTED, BenchmarkError
from fedmjp.allocator import tune_malloc
from server.offline import keep_flower_offline


def _print_trained(jobs: list) -> None:
    print(f"trained: {', '.join(job.row for job in jobs) or 'nothing (all checkpoints finished)'}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit status (see :mod:`benchmark.errors`)."""
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    keep_flower_offline()  # before anything imports flwr
    tune_malloc()  # freed tensors' memory is reused instead of faulted in again (fedmjp/allocator.py)
    t0 = time.perf_counter()
    output = None
    try:
        cfg = resolve(args)
        output = args.output or cfg["output"] or default_output(cfg)
        cfg["output"] = str(Path(output).resolve())
        from benchmark.pipeline import raise_for_errors, run_benchmark
        from benchmark.training import train_missing

        if cfg["sweep"]:
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

                RunFolder(output).check(cfg)  # a conflicting output folder fails before any training
                _print_trained(train_missing(cfg, progress=not args.no_progress))
            summary = run_benchmark(cfg, output, progress=not args.no_progress)
    except BenchmarkError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        where = f" in {output}" if output else ""
        print(f"\ninterrupted: finished rows are kept{where}; run the same command with --output {output} "
              "to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
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
