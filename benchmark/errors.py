"""Benchmark errors, each with its own process exit status (the CLI maps them; library code raises).

=====  ===================================================================================
code   meaning
=====  ===================================================================================
1      unexpected internal error (a bug: the traceback is printed)
2      command-line usage (argparse)
3      bad config: unknown model/attack/setting/key names (valid names listed), bad values
4      bad input data: missing or empty image folder, corrupt image with ``--on-corrupt fail``, an
       unusable dataset archive (unsafe members, not a tar file, no ``train/``/``val/``)
5      missing or mismatched checkpoint
6      the output folder holds a run with a different config or provenance (code version,
       library versions, device, checkpoint hashes; results are never mixed), is not a run folder
       (non-empty, without ``config.yaml`` or ``provenance.json``; ``--force`` writes into it),
       holds a symbolic link where a run writes, or holds a damaged ``config.yaml`` /
       ``provenance.json``
7      the federated run failed: no update reached the attacker, or some client updates did not (a
       client raised, timed out or dropped out of SecAgg+): the tables were written, their rows are
       failed with the reason, the same command resumes them
8      an attack raised an unexpected error (a bug, not a condition failure): the run finished and
       wrote its tables, the failure rows are marked ``error``, tracebacks are in ``errors/``
9      the output folder is in use by another run (its lock file is held)
10     the output cannot be written: no permission, read-only, a file where a folder should be, a
       full disk or a file-size limit; the rows written so far are kept, the same command resumes
11     an attack worker process died (``attack_workers``: Ray reports it killed, e.g. for want of
       memory, or crashed): the rows written so far are kept, the same command resumes
130    interrupted (Ctrl-C); finished rows are kept, re-run the same command to resume
143    terminated (SIGTERM); finished rows are kept, re-run the same command to resume
=====  ===================================================================================
"""
from __future__ import annotations

# The one error of every config (fedmjp.config): the benchmark raises and the CLI maps it like the rest
from fedmjp.config import ConfigError

__all__ = ["AttackErrors", "BenchmarkError", "ConfigError", "FederationFailed", "InputDataError",
           "AttackWorkerLost", "ModelCheckpointError", "OutputConflictError", "OutputLockedError",
           "OutputWriteError"]


class BenchmarkError(Exception):
    """Base class: a clear, user-facing problem. ``exit_code`` is the CLI's exit status."""

    exit_code = 1


class InputDataError(BenchmarkError):
    """The attack image set cannot be loaded."""

    exit_code = 4


class ModelCheckpointError(BenchmarkError):
    """A checkpoint named in the config is missing or does not fit its model row."""

    exit_code = 5


class OutputConflictError(BenchmarkError):
    """The output folder already holds results of a different config."""

    exit_code = 6


class FederationFailed(BenchmarkError):
    """The federated run produced no update to attack."""

    exit_code = 7


class AttackErrors(BenchmarkError):
    """Attacks raised unexpected errors (tracebacks in the run folder's ``errors/``)."""

    exit_code = 8


class OutputLockedError(BenchmarkError):
    """Another run holds the output folder's lock."""

    exit_code = 9


class OutputWriteError(BenchmarkError):
    """The output folder cannot be written (permission, not a folder, disk full, file too large)."""

    exit_code = 10


class AttackWorkerLost(BenchmarkError):
    """An attack worker process died under the attack (Ray: killed for memory, crashed)."""

    exit_code = 11


EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process the signal ended
