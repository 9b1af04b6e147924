"""Command line: run federated rounds, or check a finished run, with an honest exit status.

Flower's own CLI (``flwr run . --stream``) exits 0 even when every client failed; this wrapper
exits 1 when a round had no usable client update or the run made no round (with ``--strict``:
when any client failed), 3 on a bad run-config key or value or an out-dir a run cannot use,
130 on Ctrl-C. ``--check`` reads a finished run's out-dir and exits the same way (3 when the folder
is missing, not a finished run, or damaged).

    python -m server.run --clients 2 -c "setting='c' gamma=0.27 num-server-rounds=3"
    python -m server.run --engine inprocess -c "mode='fedavg' local-steps=2"
    flwr run . --stream -c "out-dir='runs/fl'"; python -m server.run --check runs/fl
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from click import ClickException
from flwr.common.config import parse_config_args

from fedmjp.text import escape_log_output
from clients.runconfig import resolve_config
from fedmjp.config import ConfigError

from .federation import ENGINES, run_federation
from .outdir import OutDirError
from .rounds import ServerOutcome

_logger = logging.getLogger("server.run")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINES, default="simulation")
    p.add_argument("--clients", type=int, default=None, help="number of clients (default: num-partitions)")
    p.add_argument("-c", "--run-config", action="append", default=[],
                   help="run-config overrides, same syntax as `flwr run -c` (key=value, TOML values)")
    p.add_argument("--client-cpus", type=float, default=1.0, help="Ray CPUs per client (simulation)")
    p.add_argument("--strict", action="store_true", help="exit 1 if any client failed in any round")
    p.add_argument("--check", metavar="OUT_DIR", default=None,
                   help="do not run: read OUT_DIR/federation.json of a finished run and exit accordingly")
    return p


EXIT_BAD_INPUT = 3
EXIT_INTERRUPTED = 130


def exit_code(failed_rounds: Sequence[int], num_failures: int, strict: bool) -> int:
    """1 if a round failed entirely (or, strict, if any client failed), else 0."""
    return 1 if failed_rounds or (strict and num_failures) else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    escape_log_output()  # untrusted names in log records are printed escaped
    try:
        outcome = _outcome(args)
    except (ConfigError, OutDirError) as err:  # a user value: one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted: the run stopped; its out-dir (if any) holds no finished outcome, re-run it",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    history, failures, failed = outcome.history, outcome.failures, outcome.failed_rounds
    for row in history:
        _logger.info("round %s: %s/%s usable replies, train-loss %s, eval-acc %s", row["round"], row.get("replies"),
                     row.get("sampled"), row.get("train-loss"), row.get("eval-acc"))
    for f in failures:
        _logger.warning("round %d node %d (partition %s): %s", f.server_round, f.node_id, f.partition_id, f.reason)
    code = exit_code(failed, len(failures), args.strict)
    if failed:
        _logger.error("rounds without any usable client update: %s", failed)
    elif not outcome.ok:
        _logger.error("the run did not succeed (%s)", "it made no round" if not history else "its outcome says ok: false")
        code = 1
    return code


def _outcome(args: argparse.Namespace) -> ServerOutcome:
    """The outcome to report: the finished run's in ``--check``'s folder, or a new run's."""
    if args.check:
        return ServerOutcome.load(args.check)
    try:
        keys = parse_config_args(args.run_config)
    except ClickException as err:  # Flower's own parser's error for a malformed -c
        raise ConfigError(f"-c {' '.join(args.run_config)!r}: {err.message}") from None
    result = run_federation(resolve_config(keys), engine=args.engine,
                            num_supernodes=args.clients, client_cpus=args.client_cpus)
    _logger.info("finished in %.1f s (%s engine)", result.seconds, result.engine)
    return result


if __name__ == "__main__":
    from fedmjp.threads import exit_process

    exit_process(main())  # not sys.exit: a client thread still running must not abort the exit
