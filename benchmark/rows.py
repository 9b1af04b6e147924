"""The schema of ``results.jsonl``: one :class:`ResultRow` per attacked image, attacker and setting.

Every line of a run's ``results.jsonl`` is written by :meth:`ResultRow.to_json`, and every row key
(what a resumed run skips) is a :class:`RowKey`; the pipeline builds rows with
:func:`client_failure_rows` and :func:`benchmark.scoring.score_round`, the store appends them and
the report reads their columns.

A column is either a field of the dataclass or one of two open groups:

* ``scores``: the scorer's columns, written between ``scored_estimate`` and ``failed``: the metrics
  the run computes (:data:`benchmark.scoring.ROW_METRICS` less LPIPS when it is off), ``clamped``,
  ``lpips_note`` and, for updates with shuffled patches, the per-region scores
  (:data:`metrics.regions.REGION_COLUMNS`), and ``flat_psnr``
  (:func:`benchmark.scoring.flat_psnr`: the floor of no information, per image). Which of them a row
  holds depends on the config.
* ``extra``: columns after the schema's, in the order given (a sweep's ``sweep``, ``sweep_index``,
  ``sweep.<key>`` and utility columns).

A field set to :data:`ABSENT` is not written: a row for a client that never replied
(:func:`client_failure_rows`) has no scores, prediction or attack statistics, and columns written
``null`` stay ``null``.

A failed row carries no score of the attacker: its metric columns are ``null`` and what the scorer
measured on the image the failed attack returned (its fallback, e.g. a flat start) is kept as
``fallback_<metric>`` (:func:`failed_scores`), so a mean over a metric column needs no filter on
``failed``. ``flat_psnr`` is the image's own floor, no reconstruction's, and stays.

The JSON form keeps the column order of the dataclass and is strict JSON (:func:`jsonable`: tensors
as lists, NaN as ``null``; a +-inf column holds its cap, :data:`CAPS` (``psnr: 100.0`` for an exact
copy), or ``null``, and a column ``<name>_raw`` beside it says ``"inf"``/``"-inf"``), so a stored line
read with :meth:`ResultRow.from_json` is written back byte for byte. Rows written before these rules
(``"psnr": "inf"``, scores on failed rows) stay readable: :func:`benchmark.aggregate.rows_frame` reads
``"inf"`` as infinity, and a row read back is written in the current form.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from defences.rero import release_mu
from defences.spec import DefenceSpec, DpSgd
from metrics.scoring import PSNR_CAP_DB


class RowKey(NamedTuple):
    """What identifies one stored row: a resumed run skips the rows whose key is stored. A plain
    tuple of these values compares and hashes equal to it."""

    model: str
    attack: str
    setting: str
    round: int
    partition_id: int
    batch_index: int
    image_id: str


#: Columns of :class:`RowKey`, in its order.
ROW_KEY = RowKey._fields
#: ``reason`` prefix of rows that failed because the run failed (a client raised, timed out or
#: sent nothing; :func:`client_failure_rows`): retried on resume, unlike an attack's condition
#: failure, which is a result.
RUN_FAILURE_PREFIX = "client failed"
#: Longest ``reason`` of a client-failure row (the server's reasons can be long tracebacks).
MAX_REASON = 300


def row_key(row: Mapping[str, Any] | ResultRow) -> RowKey:
    """The key of a row: a stored row (a mapping read from ``results.jsonl``, missing columns
    None) or a :class:`ResultRow`."""
    if isinstance(row, ResultRow):
        return row.key
    return RowKey._make(row.get(k) for k in ROW_KEY)


def is_run_failure(row: Mapping[str, Any] | ResultRow) -> bool:
    """A row that failed because the run failed (retried on resume), not a condition failure."""
    failed: object
    reason: object
    if isinstance(row, ResultRow):
        failed, reason = row.failed, row.reason
    else:
        failed, reason = row.get("failed"), row.get("reason")
    return bool(failed) and isinstance(reason, str) and reason.startswith(RUN_FAILURE_PREFIX)


class Absent:
    """The type of :data:`ABSENT` (one instance)."""

    _instance: Absent | None = None

    def __new__(cls) -> Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "ABSENT"


#: A column the row does not have (not written; distinct from ``None``, which is written ``null``).
ABSENT = Absent()


#: The value a column of +inf is written as, by metric (a column named ``psnr``, ``psnr_<region>``,
#: ``<x>_psnr``): PSNR of an exact copy counts as the cap, as in every table. Other infinite values
#: are written ``null``; either way ``<column>_raw`` holds ``"inf"`` or ``"-inf"``.
CAPS = {"psnr": PSNR_CAP_DB}
#: Prefix of the scores a failed row keeps of the image its attack returned (:func:`failed_scores`).
FALLBACK_PREFIX = "fallback_"
#: Score columns of a failed row that are no reconstruction's and stay as they are.
NOT_ATTACKER_SCORES = frozenset({"flat_psnr"})


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _infinite(value: Any) -> bool:
    value = _plain(value)
    return isinstance(value, float) and math.isinf(value)


def cap_of(column: str) -> float | None:
    """What +inf in ``column`` is written as (:data:`CAPS`), or None."""
    words = str(column).split("_")
    return next((cap for metric, cap in CAPS.items() if metric in words), None)


def jsonable(value: Any) -> Any:
    """Strict JSON data: tensors/arrays to lists, NaN to None; +-inf in a mapping to its column's
    cap (:func:`cap_of`) or None with ``<key>_raw`` ``"inf"``/``"-inf"`` beside it, elsewhere None."""
    value = _plain(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if _infinite(v):
                v = _plain(v)
                cap = cap_of(str(k))
                out[str(k)] = cap if (cap is not None and v > 0) else None
                out[f"{k}_raw"] = "inf" if v > 0 else "-inf"
            else:
                out[str(k)] = jsonable(v)
        return out
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)



@dataclass(frozen=True, kw_only=True)
class ResultRow:
    """One row of ``results.jsonl`` (module docstring). Fields are in the order they are written;
    ``image_class`` is written as ``class``."""

    model: str
    label: str | Absent = ABSENT
    trained: bool | Absent = ABSENT
    arch: str | Absent = ABSENT
    variant: str | Absent = ABSENT
    april: str | None | Absent = ABSENT
    setting: str
    group: str | Absent = ABSENT
    round: int
    partition_id: int
    node_id: int | None | Absent = ABSENT
    batch_index: int
    image_id: str
    image_index: int | Absent = ABSENT
    image_class: int | Absent = ABSENT
    pred: int | Absent = ABSENT
    correct: float | Absent = ABSENT
    correct_attacked_model: float | Absent = ABSENT
    gamma: float | Absent = ABSENT
    attack: str
    attack_name: str | Absent = ABSENT
    seed: int | Absent = ABSENT
    recon_index: int | Absent = ABSENT
    scored_estimate: str | Absent = ABSENT
    scores: Mapping[str, Any] = field(default_factory=dict)
    failed: bool
    reason: str | None | Absent = ABSENT
    error: bool | Absent = ABSENT
    attack_stats: Mapping[str, Any] | Absent = ABSENT
    time_attack_s: float | Absent = ABSENT
    time_score_s: float | Absent = ABSENT
    image_stored: bool | Absent = ABSENT
    defence: str | Absent = ABSENT
    defence_label: str | Absent = ABSENT
    defence_cos: float | Absent = ABSENT
    dp_epsilon: float | Absent = ABSENT
    dp_delta: float | Absent = ABSENT
    rero_mu: float | Absent = ABSENT
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for group in ("scores", "extra"):
            clash = [k for k in getattr(self, group) if k in _FIELD_OF]
            if clash:
                raise ValueError(f"ResultRow.{group} holds schema column(s) {clash}; set the fields instead")
        if self.failed:
            object.__setattr__(self, "scores", failed_scores(self.scores))

    @property
    def key(self) -> RowKey:
        return RowKey(self.model, self.attack, self.setting, self.round, self.partition_id, self.batch_index,
                      self.image_id)

    def to_dict(self) -> dict[str, Any]:
        """The row's columns in the order written (values as held, not yet :func:`jsonable`)."""
        out: dict[str, Any] = {}
        for name, column in _FIELDS:
            value = getattr(self, name)
            if name in _GROUPS:
                out.update(value)
            elif value is not ABSENT:
                out[column] = value
        return out

    def to_json(self) -> str:
        """The ``results.jsonl`` line of the row (no newline)."""
        return json.dumps(jsonable(self.to_dict()), allow_nan=False)

    @classmethod
    def from_mapping(cls, row: Mapping[str, Any]) -> ResultRow:
        """A row from its columns (a parsed line of ``results.jsonl``). Columns outside the schema
        that come before ``failed`` are ``scores``, those after it ``extra``, in their order.

        Raises:
            ValueError: a column of :data:`ROW_KEY` or ``failed`` is missing.
        """
        missing = [c for c in (*ROW_KEY, "failed") if c not in row]
        if missing:
            raise ValueError(f"a result row needs the column(s) {missing}; it has {list(row)[:12]}")
        kwargs: dict[str, Any] = {}
        scores: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        after_failed = False
        for column, value in row.items():
            name = _FIELD_OF.get(column)
            if name is not None:
                kwargs[name] = value
                after_failed = after_failed or column == "failed"
            elif after_failed:
                extra[column] = value
            else:  # a row written before the strict form: "inf" read as the number it stood for
                old = value in _OLD_INFINITIES and not column.endswith("_raw")
                scores[column] = float(value) if old else value
        return cls(**kwargs, scores=scores, extra=extra)

    @classmethod
    def from_json(cls, line: str | bytes) -> ResultRow:
        """A row from one line of ``results.jsonl``."""
        data = json.loads(line)
        if not isinstance(data, dict):
            raise TypeError(f"a result row is a JSON object, got {type(data).__name__}")
        return cls.from_mapping(data)


#: How rows written before the strict form held an infinite score.
_OLD_INFINITIES = ("inf", "-inf")


def _is_score(column: str, value: Any) -> bool:
    value = _plain(value)
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and column not in NOT_ATTACKER_SCORES
            and not column.startswith(FALLBACK_PREFIX) and not column.endswith("_raw"))


def failed_scores(scores: Mapping[str, Any]) -> dict[str, Any]:
    """The scores of a failed row: each metric of the attacker ``None`` in its place, what was
    measured on the fallback image as ``fallback_<metric>`` after them (``<metric>_raw`` of an
    infinite value moves with it); columns already so (a row read back) are kept as they are."""
    scores = dict(scores)
    moved = [k for k, v in scores.items() if _is_score(k, v)]
    fallback: dict[str, Any] = {}
    for k in moved:
        fallback[FALLBACK_PREFIX + k] = scores[k]
        if f"{k}_raw" in scores:
            fallback[f"{FALLBACK_PREFIX}{k}_raw"] = scores.pop(f"{k}_raw")
        scores[k] = None
    return {**scores, **fallback}


#: Fields written as another column name (``class`` is a Python keyword).
_RENAMED = {"image_class": "class"}
#: The open groups of columns (flattened where the field stands).
_GROUPS = frozenset({"scores", "extra"})
#: (field name, column name) in the order written.
_FIELDS = tuple((f.name, _RENAMED.get(f.name, f.name)) for f in dataclasses.fields(ResultRow))
#: column name -> field name, for the fields that are one column.
_FIELD_OF = {column: name for name, column in _FIELDS if name not in _GROUPS}
#: Every column a row may hold outside its open groups, in the order written.
COLUMNS = tuple(_FIELD_OF)


@dataclass(frozen=True)
class RowContext:
    """What every row of one federation shares: the model row, the setting group, the run's seed,
    the clients' defence, and where each image sits in the attack set.

    Attributes:
        defence: the clients' defence spec (typed, as the run config sends it; ``label`` for tables).
        image_index: image id -> position in the attack set (the batch's own index where missing).
        federation: the batch size, local steps and label threat model of the rows (``extra`` columns).
        flat_colour: the model's input normalisation mean (one value per channel, in [0, 1]): the
            colour of the flat image every row's ``flat_psnr`` scores; None: no such column.
    """

    model: str
    label: str
    trained: bool
    arch: str
    variant: str
    april: str | None
    group: str
    seed: int
    defence: DefenceSpec
    image_index: Mapping[str, int] = field(default_factory=dict)
    #: columns every row of the federation carries after ``failed``: ``batch_size``, ``local_steps``
    #: and ``labels`` (the threat model: ``known`` or ``recovered``)
    federation: Mapping[str, Any] = field(default_factory=dict)
    flat_colour: tuple[float, ...] | None = None

    def defence_columns(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """The defence fields of a row: the defence's name and label, and what the client reported
        in its update's metrics (cosine similarity of the sent update to its clean one, DP-SGD's
        epsilon; the delta comes from the spec) and, for a Gaussian DP defence at the client,
        ``rero_mu``: the sent update's mu as a Gaussian-DP release of each image of the batch
        (:func:`defences.rero.release_mu`; the ReRo bound's mu)."""
        out = {"defence": self.defence.name, "defence_label": self.defence.label,
               "defence_cos": float(metrics.get("defence-cos", 1.0))}
        if "dp-epsilon" in metrics and isinstance(self.defence, DpSgd):
            out["dp_epsilon"], out["dp_delta"] = float(metrics["dp-epsilon"]), self.defence.delta
        if "batch_size" in self.federation:  # the tapped update as a Gaussian-DP release of each image
            mu = release_mu(self.defence, int(self.federation["batch_size"]),
                            int(self.federation.get("local_steps", 1)))
            if mu is not None and math.isfinite(mu):
                out["rero_mu"] = mu
        return out


def client_failure_rows(ctx: RowContext, rnd: int, partition: int, batch: Any, reasons: Sequence[str],
                        attackers: Sequence[tuple[str, str]], settings: Sequence[str]) -> list[ResultRow]:
    """Rows of a client update that never reached the attacker (the client raised, timed out or
    sent a malformed reply): one failed row per image of its private batch, attacker and setting,
    with the server's reasons (retried on resume: :func:`is_run_failure`).

    Args:
        batch: the client's private batch (:class:`clients.partition.PrivateBatch`).
        reasons: the server's reasons for the failure (may be empty).
        attackers: (label, registry name) of each attacker, in the run's order.
    """
    text = "client failed: " + " | ".join(reasons or ["no update from this client"])
    reason = " ".join(text.split())[:MAX_REASON]
    rows = []
    for s in settings:
        for label, name in attackers:
            for b, image_id in enumerate(batch.image_ids):
                rows.append(ResultRow(
                    model=ctx.model, label=ctx.label, trained=ctx.trained, arch=ctx.arch, variant=ctx.variant,
                    setting=s, group=ctx.group, round=int(rnd), partition_id=int(partition), node_id=None,
                    batch_index=b, image_id=image_id, image_index=ctx.image_index.get(image_id, int(batch.indices[b])),
                    image_class=int(batch.labels[b]), gamma=float(batch.gamma), attack=label, attack_name=name,
                    seed=ctx.seed, failed=True, reason=reason, image_stored=False))
    return rows


def dumps(rows: Iterable[ResultRow]) -> Iterable[str]:
    """The ``results.jsonl`` lines of ``rows``."""
    return (row.to_json() for row in rows)
