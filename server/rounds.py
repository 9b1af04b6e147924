"""The server side of a run: build the global model, run the strategy, collect the outcome.

Kept apart from ``server_app.py`` so that the ServerApp stays a thin wrapper.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid

from clients.partition import public_eval_set
from clients.records import decode_state, encode_state
from clients.runconfig import ROUND_KEYS, RunConfig
from clients.update import clone_state, load_global_model
from defences.spec import CentralDp
from fedmjp.evaluate import loss_and_top1
from fedmjp.factory import model_input_stats

from .strategy import FedSGD, ServerOptimizer, TappedFedAvg
from .outdir import FINAL_STATE_FILE, MARKER, OUTCOME_FILE, OutDir, OutDirError, read_marker
from .tap import Failure, FolderTap, Tap

_logger = logging.getLogger(__name__)


@dataclass
class ServerOutcome:
    """What the server knows when the run ends.

    Attributes:
        history: one dict per round: round, sampled, replies, failures, train-loss, seconds and,
            with server-eval, eval-loss and eval-acc.
        failures: every client that did not deliver a usable update.
        final_state: global state dict after the last round (CPU tensors).
        node_partitions: node id -> self-reported partition id.
        recorded_ok: what a saved outcome's ``ok`` said (True for a run's own outcome).
    """

    history: list[dict[str, Any]]
    failures: list[Failure]
    final_state: dict[str, torch.Tensor]
    node_partitions: dict[int, int] = field(default_factory=dict)
    recorded_ok: bool = True

    @property
    def failed_rounds(self) -> list[int]:
        """Rounds in which no client delivered a usable update."""
        return [h["round"] for h in self.history if h.get("replies", 0) == 0]

    @property
    def ok(self) -> bool:
        """The run made at least one round and every round had a usable update."""
        return bool(self.history) and not self.failed_rounds and self.recorded_ok

    def save(self, out: OutDir) -> None:
        """Write ``final_state.pt`` and then ``federation.json`` (history, failures) through the
        out-dir's guarded writer, and mark the run finished."""
        summary = {
            "run": out.run_id, "ok": self.ok, "failed_rounds": self.failed_rounds, "history": self.history,
            "failures": [f.to_dict() for f in self.failures],
            "node_partitions": {str(k): v for k, v in self.node_partitions.items()},
        }
        out.save_torch(FINAL_STATE_FILE, self.final_state)
        out.write(OUTCOME_FILE, json.dumps(summary, indent=2, default=_json_default).encode())
        out.finish()

    @classmethod
    def load(cls, folder: str | Path) -> "ServerOutcome":
        """The outcome a finished run saved in its out-dir, every part checked.

        Raises:
            OutDirError: the folder is missing or not a finished run's out-dir, or a file is damaged
                (the message names the file).
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise OutDirError(f"{folder} is not a folder (a server run's out-dir)")
        path = folder / OUTCOME_FILE
        if not path.is_file():
            raise OutDirError(f"{path} is missing or not a file: {folder} holds no finished run (was it killed?)")
        try:
            summary = json.loads(path.read_bytes().decode())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise OutDirError(f"{path} is not the JSON a server run writes ({err})") from None
        try:
            history, failures, partitions, recorded_ok = _checked_summary(summary)
        except (TypeError, ValueError, KeyError) as err:
            raise OutDirError(f"{path} is damaged: {err}") from None
        marker = read_marker(folder)
        if marker and (not marker.get("finished") or summary.get("run", marker["run"]) != marker["run"]):
            raise OutDirError(f"{path} is not of run {marker['run']}, which {folder / MARKER} names and which did "
                              "not finish (was it killed?); re-run it")
        state_path = folder / FINAL_STATE_FILE
        state: dict[str, torch.Tensor] = {}
        if os.path.lexists(state_path):
            try:
                state = torch.load(state_path, map_location="cpu", weights_only=True)
            except Exception as err:  # noqa: BLE001  (torch raises many types for a damaged file)
                raise OutDirError(f"{state_path} is not a state dict a server run wrote ({type(err).__name__})") \
                    from None
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise OutDirError(f"{state_path} is not a state dict of tensors")
        return cls(history, failures, state, partitions, recorded_ok=recorded_ok)


def _checked_summary(summary: Any) -> tuple[list[dict[str, Any]], list[Failure], dict[int, int], bool]:
    """History, failures and node partitions of a ``federation.json``, each checked (raises
    TypeError, ValueError or KeyError naming the part)."""
    if not isinstance(summary, dict):
        raise TypeError(f"it holds a {type(summary).__name__}, not an object")
    history = summary["history"]
    if not isinstance(history, list) or not all(isinstance(h, dict) and isinstance(h.get("round"), int)
                                                and isinstance(h.get("replies", 0), int) for h in history):
        raise TypeError("'history' must be a list of rounds, each with an integer 'round' and 'replies'")
    failures = summary.get("failures", [])
    if not isinstance(failures, list) or not all(isinstance(f, dict) for f in failures):
        raise TypeError("'failures' must be a list of objects")
    parsed = [Failure(int(f["server_round"]), int(f["node_id"]),
                      None if f.get("partition_id") is None else int(f["partition_id"]), str(f["reason"]))
              for f in failures]
    partitions = summary.get("node_partitions", {})
    if not isinstance(partitions, dict):
        raise TypeError("'node_partitions' must be an object")
    ok = summary.get("ok", True)
    if not isinstance(ok, bool):
        raise TypeError(f"'ok' must be true or false, got {ok!r}")
    return history, parsed, {int(k): int(v) for k, v in partitions.items()}, ok


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def server_metadata(cfg: RunConfig, model: torch.nn.Module) -> dict[str, Any]:
    """What the server knows about every update: its own round config and the model."""
    mean, std = model_input_stats(model)
    wire = cfg.wire()
    meta = {k: wire[k] for k in ("mode", "setting", "gamma", "per-sample", "batch-size", "local-steps", "lr",
                                "dal-weight", "image-size")}
    meta.update({"input-mean": list(mean), "input-std": list(std), "model-spec": cfg.model_spec()})
    meta["run-config"] = wire  # all of it: what an attack on a stored capture rebuilds the run from
    return meta


def _with_central_dp(strategy: Any, cfg: RunConfig) -> Any:
    """Flower's server-side DP wrapper around ``strategy`` when the defence is central_dp."""
    spec = cfg.defence
    if not isinstance(spec, CentralDp):
        return strategy
    from .central_dp import TappedCentralDp

    num_sampled = max(1, int(cfg.fraction_train * cfg.min_nodes))
    return TappedCentralDp(strategy, spec.sigma, spec.clip, num_sampled, seed=cfg.seed)


def run_rounds(grid: Grid, cfg: RunConfig, tap: Optional[Tap] = None) -> ServerOutcome:
    """Run ``num-server-rounds`` rounds of FedSGD or FedAvg on ``grid``; returns the outcome.

    With ``out-dir`` set in the config, every update is also stored there (:class:`FolderTap`) and
    the outcome is saved, so runs whose server lives in another process can be read back. With
    ``secagg`` the rounds run under Flower's SecAgg+ (:mod:`server.secagg`) and the tap sees one
    aggregate per round.
    """
    out = OutDir.open(cfg.out_dir) if cfg.out_dir else None  # locked and checked before any work
    try:
        return _run_rounds(grid, cfg, tap, out)
    finally:
        if out is not None:
            out.close()


def _run_rounds(grid: Grid, cfg: RunConfig, tap: Optional[Tap], out: Optional[OutDir]) -> ServerOutcome:
    model = load_global_model(cfg)
    taps = [t for t in (tap, FolderTap(out) if out is not None else None) if t]

    def tap_all(update: Any) -> None:
        for t in taps:
            t(update)

    metadata = server_metadata(cfg, model)
    # The public split (images of the source no client owns), never the clients' private images.
    eval_data = public_eval_set(cfg) if cfg.server_eval else None
    if cfg.secagg:
        return _run_secagg_rounds(grid, cfg, model, tap_all if taps else None, metadata, eval_data, out)
    common = dict(
        tap=tap_all if taps else None, metadata=metadata,
        fraction_train=cfg.fraction_train, fraction_evaluate=0.0,
        min_train_nodes=1, min_available_nodes=cfg.min_nodes,
    )
    tapped = (FedSGD(lr=cfg.lr, **common) if cfg.mode == "fedsgd"
              else TappedFedAvg(server_opt=ServerOptimizer.from_config(cfg), **common))
    strategy = _with_central_dp(tapped, cfg)
    train_config = ConfigRecord({k: v for k, v in cfg.wire().items() if k in ROUND_KEYS})

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> Optional[MetricRecord]:
        model.load_state_dict(decode_state(arrays), strict=True)
        loss, acc = loss_and_top1(model, eval_data.images, eval_data.labels)
        return MetricRecord({"eval-loss": loss, "eval-acc": acc})

    result = strategy.start(
        grid=grid, initial_arrays=encode_state(model.state_dict()), num_rounds=cfg.num_server_rounds,
        timeout=cfg.round_timeout, train_config=train_config,
        evaluate_fn=evaluate_fn if eval_data is not None else None,
    )
    history = []
    for r in range(1, cfg.num_server_rounds + 1):
        row = dict(tapped.rounds.get(r, {"round": r, "sampled": 0, "replies": 0, "failures": 0}))
        if r in result.evaluate_metrics_serverapp:
            row.update({k: float(v) for k, v in result.evaluate_metrics_serverapp[r].items()})
        history.append(row)
    final = decode_state(result.arrays) if result.arrays is not None else clone_state(model.state_dict())
    return _finish(out, ServerOutcome(history, list(tapped.failures), final, dict(tapped.node_partitions)))


def _finish(out: Optional[OutDir], outcome: ServerOutcome) -> ServerOutcome:
    """Save the outcome in the out-dir (if any) and log each round."""
    if out is not None:
        outcome.save(out)
    for row in outcome.history:
        _logger.info("round %d: %d/%d replies, train-loss %.4f", row["round"], row["replies"], row["sampled"],
                     row.get("train-loss", float("nan")))
    return outcome


def _run_secagg_rounds(grid: Grid, cfg: RunConfig, model: torch.nn.Module, tap: Optional[Tap],
                       metadata: dict[str, Any], eval_data: Any, out: Optional[OutDir]) -> ServerOutcome:
    """The rounds under Flower's SecAgg+ (:mod:`server.secagg`): the tap sees one aggregate per round."""
    from flwr.app import Context, RecordDict

    from .secagg import SecAggStrategy, run_secagg

    def evaluate_fn(server_round: int, state: dict[str, torch.Tensor]) -> dict[str, float]:
        model.load_state_dict(state, strict=True)
        loss, acc = loss_and_top1(model, eval_data.images, eval_data.labels)
        return {"eval-loss": loss, "eval-acc": acc}

    strategy = SecAggStrategy(cfg, model, tap, metadata, evaluate_fn if eval_data is not None else None)
    # The legacy workflow runs on a Context of its own (its state holds the protocol's records).
    context = Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=cfg.wire())
    run_secagg(grid, context, strategy)
    history = [dict(strategy.rounds.get(r, {"round": r, "sampled": 0, "replies": 0, "failures": 0}))
               for r in range(1, cfg.num_server_rounds + 1)]
    return _finish(out, ServerOutcome(history, list(strategy.failures), clone_state(strategy.state),
                                      dict(strategy.node_partitions)))
