"""One federation's attacks: assembles each round's tapped updates, dispatches the attacks, scores
and stores the rows.

:class:`GroupAttacker` runs one federation (a model row and a gradient group) with the server's tap
feeding an attack thread; :class:`RoundCollector` groups the tapped updates into rounds; each round
goes to the runner (:class:`benchmark.workers.RoundDispatch`) as one call per attacker, each update's
metadata carrying the round's estimate store of that update, and once its attacks are done, its
results are scored (:mod:`benchmark.scoring`) and appended to the run folder with the grid images.
:func:`benchmark.federation_inputs.attack_metadata` is what the attacks are told besides an update.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from torch import nn
from tqdm.auto import tqdm

from fedmjp.text import printable
from fedmjp.threads import start_daemon

from . import scoring
from .errors import AttackWorkerLost, FederationFailed
from .federation_inputs import attack_metadata, grid_image_ids, row_context
from .inputs import Attacker, ModelRow, Prepared, client_run_config, expected_updates
from .rows import RowKey, client_failure_rows
from .secure_aggregation import tapped_batch
from .files import slug
from .store import RunFolder
from .workers import AttackCall

if TYPE_CHECKING:
    from attacks.api.progress import Reporter

    from .workers import Runner

_logger = logging.getLogger(__name__)

_END, _ABORT = object(), object()  # what the federation's end tells the attack thread
#: Longest a wait of the main thread blocks at once (a hand-over to the attack thread, its join): it
#: wakes at least this often, so a signal (SIGTERM, Ctrl-C) is acted on while an attack runs long.
WAKE_SECONDS = 0.2
#: How long an aborted federation (an error, SIGTERM, Ctrl-C) waits for the attack thread to stop;
#: one still inside a long attack step is left behind (a daemon thread: it never keeps the process).
ABORT_GRACE_SECONDS = 1.0


def round_keys(model: str, attackers: list[Attacker], settings: list[str], rnd: int, part: int,
               image_ids: list[str]) -> dict[tuple[str, str, int], RowKey]:
    """(attacker label, setting, batch index) -> the row key, for every row one update gives."""
    return {(a.label, s, b): RowKey(model, a.label, s, rnd, part, b, image_id)
            for a in attackers for s in settings for b, image_id in enumerate(image_ids)}


class RoundCollector:
    """Groups a federation's tapped updates into rounds, in the order the server saw them.

    A round is complete once every expected client of it has replied; a round with a missing
    client is complete when the next round starts or the federation ends (:meth:`close`). Updates
    of (round, partition) pairs not expected (beyond a dry run's first) are dropped.
    """

    def __init__(self, wanted: set[tuple[int, int]]) -> None:
        self.wanted = wanted
        self.seen: set[tuple[int, int]] = set()  # (round, partition) pairs tapped
        self.buffer: list[Any] = []  # the current round's updates

    def add(self, update: Any) -> list[list[Any]]:
        """Take one update; returns the rounds it completed (zero, one or two)."""
        rnd, part = int(update.server_round), int(update.partition_id)
        if (rnd, part) not in self.wanted:
            return []
        done = []
        if self.buffer and int(self.buffer[0].server_round) != rnd:
            done.append(self.close())  # a round with a missing client: its updates are attacked now
        self.seen.add((rnd, part))
        self.buffer.append(update)
        if {(r, p) for r, p in self.wanted if r == rnd} <= self.seen:
            done.append(self.close())
        return [r for r in done if r]

    def close(self) -> list[Any]:
        """The updates collected (the round so far) and an empty buffer."""
        updates, self.buffer = self.buffer, []
        return updates

    def missing(self) -> list[tuple[int, int]]:
        """Expected (round, partition) pairs never tapped, in order."""
        return sorted(self.wanted - self.seen)


@dataclass
class _Round:
    """One round's tapped updates of one federation, on their way through attack and scoring.

    ``jobs`` holds, per attacker, the runner's job and the positions (in ``updates``) it attacks.
    """

    rnd: int
    updates: list
    batches: list
    keys: list[dict[tuple[str, str, int], RowKey]]
    top1: scoring.RoundTop1
    jobs: list[tuple[Attacker, Any, list[int]]] = field(default_factory=list)


class _SameRun:
    """The job of an attacker that computes what an earlier attacker of the round computes
    (:meth:`attacks.api.base.Attack.run_key`): that attacker's results, each image's notes saying so."""

    def __init__(self, label: str, job: Any) -> None:
        self.label, self.job = label, job

    def result(self) -> Any:
        results, seconds = self.job.result()
        note = f"the run of {self.label} (same attack and options on this model)"
        return [replace(r, stats=[dict(st, notes=[*(st.get("notes") or []), note]) for st in r.stats]) for r in results], seconds


def _run_key(attacker: Attacker, model: nn.Module) -> Any:
    """The attacker's :meth:`attacks.api.base.Attack.run_key` on ``model``; None where it does not say
    (an attack without parsed options, e.g. a plug-in factory's)."""
    options, run_key = getattr(attacker.attack, "options", None), getattr(attacker.attack, "run_key", None)
    return None if options is None or run_key is None else run_key(options, model)


class GroupAttacker:
    """Runs one federation and attacks its tapped updates, one round at a time, in an attack thread.

    The concurrency shell around :class:`RoundCollector`, :func:`benchmark.scoring.round_top1`,
    :func:`benchmark.scoring.score_round` and :func:`benchmark.rows.client_failure_rows`: the
    server's tap only queues each update (:meth:`tap`); the attack thread (:meth:`work`) takes them
    in the server's order, so the clients compute round r + 1 while round r is attacked and scored
    (on 2 CPU cores the two overlap; the rows do not depend on it: the attack thread alone touches
    the server's model copy, the scorer and the results file). Once a round is complete, each
    attacker gets all of its updates in one ``reconstruct_many`` call on the runner (batched attacks
    solve them together; on Ray workers, the federation goes on meanwhile); the round waits in
    :class:`benchmark.workers.RoundDispatch` until its attacks are done, then (:meth:`finish_round`)
    the results are scored per round and setting and appended. ``batched=False`` attacks one update per
    ``reconstruct`` call (the reference path; the rows are the same).
    """

    def __init__(self, prepared: Prepared, run: RunFolder, row: ModelRow, group: str, settings: list[str],
                 done: set[RowKey], progress: bool, runner: Runner | None = None, batched: bool = True) -> None:
        from .workers import LocalRunner, RoundDispatch

        self.p, self.run_folder, self.row, self.group, self.settings = prepared, run, row, group, settings
        self.cfg = prepared.cfg
        self.done = done
        # the rounds on the runner; each comes back to finish_round once its attacks are done
        self.dispatch: RoundDispatch[_Round] = RoundDispatch(
            runner if runner is not None else LocalRunner([a.attack for a in prepared.attackers]),
            self.finish_round, batched)
        self.resolved = client_run_config(self.cfg, row, group)
        self.ctx = row_context(self.cfg, row, group, self.resolved, prepared.image_names)
        # The classifier-bias gradient carries the attacked model's prediction when the update is a
        # plain FedSGD gradient (no defence transforms it); see scoring.round_top1.
        plain = self.resolved.mode == "fedsgd" and self.resolved.defence.name == "none"
        self.gradient_readout = scoring.classifier_bias_name(row.model) if plain else None
        self.forward_top1 = 0  # updates whose attacked-model top-1 needed a forward pass
        self.rounds = RoundCollector(set(expected_updates(self.cfg)))
        # The server's copy is the row's own model: every use loads the federation's weights first
        # (strict, so nothing of an earlier federation survives; block-0 norm1, which the surgery
        # removed, is never in them), and run() restores the row's weights at the end. A deepcopy
        # per federation cost more than the attacks of a round.
        self.model = row.model
        self.acc_model = row.acc_model
        self.pristine = {k: v.detach().clone() for k, v in row.model.state_dict().items()}
        self.grid_ids = grid_image_ids(self.cfg, self.resolved)
        # attacker label -> its Attack.run_key on this row's model (None: never shared)
        self.run_keys: dict[str, Any] = {a.label: _run_key(a, self.model) for a in prepared.attackers}
        self.new_rows = self.failed_rows = self.error_rows = 0
        self.client_failed_rows = 0  # rows of updates that never reached the attacker (retried on resume)
        # round -> the partitions a SecAgg+ aggregate covered when some of the clients dropped out
        self.partial_aggregates: dict[int, list[int]] = {}
        self.error: BaseException | None = None
        self.aborted = False
        # Updates on their way from the server's tap to the attack thread; a round and a half of
        # them at most, so the server runs one round ahead and no further.
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=max(1, (3 * self.cfg.federation.clients) // 2))
        self.bar = tqdm(total=len(self.rounds.wanted), desc=f"attack {row.name} [{group}]", unit="upd",
                        leave=False, disable=None if progress else True)  # None: off a terminal

    def run(self, federate: Callable[..., Any] | None) -> None:
        from server.federation import run_federation

        t0 = time.perf_counter()
        worker = start_daemon(self.work, f"attack-{self.row.name}-{self.group}")
        finished = False
        try:
            if federate is None:
                # Ray stays up between federations of one benchmark (its start-up is paid once);
                # run_benchmark shuts it down at the end.
                result = run_federation(self.resolved, tap=self.tap, engine=self.cfg.federation.engine,
                                        keep_ray=True)
            else:
                result = federate(self.resolved, tap=self.tap, engine=self.cfg.federation.engine)
            finished = True
        finally:
            self.aborted = not finished  # an error or Ctrl-C: the thread drops what is queued
            self.hand_over(_END if finished else _ABORT)
            self.wait_for(worker, finished)
            if not worker.is_alive():  # a thread left inside a long attack step still holds the model
                self.model.load_state_dict(self.pristine, strict=True)
        self.bar.close()
        if self.error is not None:
            raise self.error
        self.record_client_failures(result)
        _logger.info("%s/%s: federation and attacks took %.1f s; the attacked model's top-1 needed a forward for "
                     "%d update(s), the others were read off their gradients", self.row.name, self.group,
                     time.perf_counter() - t0, self.forward_top1)
        if self.p.scorer.lpips_cache is not None:
            _logger.info("LPIPS features so far: %(computed)d image(s) computed, %(reused)d reused; %(kept_images)d "
                         "reference(s) kept (%(kept_bytes)d bytes)", self.p.scorer.lpips_cache.stats())

    def hand_over(self, marker: object) -> None:
        """Put the end marker in ``inbox`` after every queued update, waiting for room in waits of
        :data:`WAKE_SECONDS` (a signal ends the wait); the abort marker never waits: queued updates,
        which the thread would drop anyway, make room for it."""
        while True:
            try:
                if marker is _ABORT:
                    self.inbox.put_nowait(marker)
                else:
                    self.inbox.put(marker, timeout=WAKE_SECONDS)
                return
            except queue.Full:
                if marker is _ABORT:
                    with contextlib.suppress(queue.Empty):
                        self.inbox.get_nowait()

    def wait_for(self, worker: threading.Thread, finished: bool) -> None:
        """Join the attack thread in joins of :data:`WAKE_SECONDS` (a signal ends the wait): until
        it has attacked every update of a finished federation, at most :data:`ABORT_GRACE_SECONDS`
        after an abort (an attack inside a long step is not waited for)."""
        deadline = None if finished else time.monotonic() + ABORT_GRACE_SECONDS
        while worker.is_alive() and (deadline is None or time.monotonic() < deadline):
            worker.join(timeout=WAKE_SECONDS)

    def tap(self, update: Any) -> None:
        """The server's tap: hands the update to the attack thread (:meth:`work`) and returns, so
        that the clients compute the next round while this one is attacked and scored. Waits while
        ``inbox`` is full (the updates held in memory stay bounded). An error of the attack thread
        is raised here (aborting the federation) and again after the federation returns, so that an
        engine running the ServerApp in a thread cannot swallow it.

        A SecAgg+ aggregate that misses some clients (they dropped out) is not the round's update
        the config describes (the mean of all its clients' batches): it is not attacked, and the
        round's images become failed rows (:meth:`record_client_failures`), tried again on resume."""
        covers = getattr(update, "partition_ids", None)
        if getattr(update, "is_aggregate", False) and len(set(covers or ())) < self.cfg.federation.clients:
            self.partial_aggregates[int(update.server_round)] = sorted(set(covers or ()))
            return
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.inbox.put(update, timeout=0.2)
                return
            except queue.Full:
                continue

    def work(self) -> None:
        """The attack thread: every tapped update in the order the server saw them, then (at the
        end of the federation) the last round and every round still in flight."""
        update = None
        try:
            while True:
                update = self.inbox.get()
                if update is _ABORT:
                    return
                if update is _END:
                    last = self.rounds.close()
                    if last:
                        self.submit_round(last)
                    self.dispatch.drain(keep=0)
                    return
                if not self.aborted:
                    for updates in self.rounds.add(update):
                        self.submit_round(updates)
                    self.dispatch.drain()
        except BaseException as err:  # noqa: BLE001  (re-raised by tap() and run(); never swallowed)
            self.error = err
            # let tap() return until run() sends the end marker; an error while finishing (the marker
            # already taken, e.g. a Ray attack worker killed during the last drain) must not wait
            # for a second marker that never comes
            while update is not _END and self.inbox.get() not in (_END, _ABORT):
                pass

    # ---------------------------------------------------------------------------------- a round
    def submit_round(self, updates: list) -> None:
        """Top-1 of the round's images, then one runner job per attacker over the updates that
        still miss rows of that attacker; the round goes to :attr:`dispatch` until they are done."""
        from attacks.api import progress
        from attacks.api.estimates import EstimateStore

        rnd = int(updates[0].server_round)
        clients = self.cfg.federation.clients
        batches = [tapped_batch(self.resolved, int(u.partition_id), rnd, clients, getattr(u, "partition_ids", None))
                   for u in updates]
        keys = [round_keys(self.row.name, self.p.attackers, self.settings, rnd, int(u.partition_id), b.image_ids)
                for u, b in zip(updates, batches)]
        todo = [i for i, k in enumerate(keys) if not all(v in self.done for v in k.values())]
        self.bar.update(len(updates) - len(todo))
        if not todo:
            return
        updates, batches, keys = [updates[i] for i in todo], [batches[i] for i in todo], [keys[i] for i in todo]
        # Every update of a round carries the same global weights (the state the server sent).
        state = {k: v.to(self.p.device) for k, v in updates[0].global_state.items()}
        self.model.load_state_dict(state, strict=True)
        self.model.eval()
        acc_model = None if self.acc_model is None else self.acc_model_at(state)
        top1, forwards = scoring.round_top1(self.model, acc_model, updates, batches, self.p.device,
                                            self.gradient_readout)
        self.forward_top1 += forwards
        round_ = _Round(rnd, updates, batches, keys, top1)
        model = self.dispatch.share(self.model)  # e.g. shipped to Ray's object store once per round
        # One store per update, for this round's calls only: what one attacker estimates from an
        # update (mjp_adaptive's x~), another attacker of the same update starts from (ig_closed_start).
        stores = [EstimateStore() for _ in updates]
        calls: list[AttackCall] = []
        mines: list[tuple[Attacker, list[int]]] = []
        # attackers that compute the same thing on this model (Attack.run_key: the preset's
        # ig_plain_forward is ig_closed_start on a plain ViT) run once; the others score its results
        first: dict[tuple, int] = {}
        same: list[tuple[Attacker, int, list[int]]] = []
        for index, attacker in enumerate(self.p.attackers):
            mine = [i for i, (batch, k) in enumerate(zip(batches, keys))
                    if not all(k[(attacker.label, s, b)] in self.done for s in self.settings
                               for b in range(len(batch.image_ids)))]
            if not mine:
                continue
            key = self.run_keys[attacker.label]
            if key is not None and (key, tuple(mine)) in first:
                same.append((attacker, first[(key, tuple(mine))], mine))
                continue
            if key is not None:
                first[(key, tuple(mine))] = len(calls)
            metadata = [replace(attack_metadata(self.cfg, self.resolved, self.model, batches[i]), estimates=stores[i])
                        for i in mine]
            calls.append(AttackCall(index, [updates[i].arrays for i in mine], metadata))
            mines.append((attacker, mine))
        with progress.reporting(self.attack_progress(rnd, [int(u.partition_id) for u in updates])):
            jobs = self.dispatch.submit(model, calls) if calls else []
        self.bar.set_postfix_str("", refresh=False)
        round_.jobs = [(attacker, job, mine) for (attacker, mine), job in zip(mines, jobs)]
        round_.jobs += [(attacker, _SameRun(mines[at][0].label, jobs[at]), mine) for attacker, at, mine in same]
        self.dispatch.add(round_, jobs)

    def attack_progress(self, rnd: int, partitions: list[int]) -> Reporter:
        """Where the attacks of round ``rnd`` (its ``partitions``' updates) report their iterations
        (:mod:`attacks.api.progress`): the bar's postfix where the bar shows, else a log line every
        :data:`attacks.api.progress.LOG_EVERY_S` seconds. Attacks on Ray workers report to no one."""
        from attacks.api import progress

        if not self.bar.disable:
            return progress.Reporter(lambda step: self.bar.set_postfix_str(step.short()), progress.BAR_EVERY_S)
        where = f"round {rnd}, partition{'s' if len(partitions) > 1 else ''} {', '.join(map(str, partitions))}"
        return progress.Reporter(lambda step: _logger.info(
            "%s/%s: attack %s on %s: %s, %.0f s", printable(self.row.name), self.group, printable(step.attack), where,
            step.text(), step.seconds), progress.LOG_EVERY_S)

    def finish_round(self, r: _Round) -> None:
        """Score every attacker's results of the round under each setting; append the rows and
        store the grid images."""
        scored: list[scoring.ScoredImage] = []
        for attacker, job, mine in r.jobs:
            results, seconds = self.job_result(attacker, job, r.rnd)
            n_images = sum(len(r.batches[i].image_ids) for i in mine)
            for i, result in zip(mine, results):
                if result.error is not None:
                    self.record_error(attacker.label, r.rnd, int(r.updates[i].partition_id), result.error)
            for s in self.settings:
                scored += scoring.score_round(
                    self.ctx, (attacker.label, attacker.name), s, [r.updates[i] for i in mine],
                    [r.batches[i] for i in mine], results, r.top1.take(mine), self.p.scorer,
                    # ignore: patch_size is a plain tuple attribute of a timm-style patch embedding,
                    # which torch types as Tensor | Module (see benchmark.pipeline.build_rows)
                    int(self.model.patch_embed.patch_size[0]),  # type: ignore[union-attr, index]
                    seconds / max(n_images, 1), skip=self.done,
                    grid_ids=self.grid_ids)
        batch_of = {int(u.partition_id): b for u, b in zip(r.updates, r.batches)}  # one update per partition
        for item in scored:
            if item.row.image_stored:
                batch, b = batch_of[item.row.partition_id], item.row.batch_index
                self.run_folder.save_row_images(item.row, batch.images[b],
                                                None if batch.shuffled is None else batch.shuffled[b],
                                                item.reconstruction)
        rows = [item.row for item in scored]
        self.run_folder.append(rows)
        for k in r.keys:
            self.done.update(k.values())
        self.new_rows += len(rows)
        self.failed_rows += sum(bool(x.failed) for x in rows)
        self.error_rows += sum(bool(x.error) for x in rows)
        self.bar.update(len(r.updates))

    def job_result(self, attacker: Attacker, job: Any, rnd: int) -> Any:
        """An attack job's (results, seconds). Its attack's own errors are already error rows
        (:func:`benchmark.workers.run_attack`); a Ray worker process that died under it (killed for
        memory, crashed) is not the attack's fault and not a bug here: :class:`AttackWorkerLost`,
        after which the CLI keeps the rows written and the same command resumes."""
        try:
            return job.result()
        except Exception as err:  # noqa: BLE001  (only Ray's own errors are translated; the rest re-raised)
            if not type(err).__module__.startswith("ray."):
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise AttackWorkerLost(
                f"the attack worker running {printable(attacker.label)} on round {rnd} of "
                f"{printable(self.row.name)} died ({type(err).__name__}: {printable(first)[:300]}); the rows "
                "written so far are kept: run the same command to resume (with fewer attack workers, "
                "--attack-workers, where it ran out of memory)") from None

    def acc_model_at(self, state: dict) -> nn.Module:
        """The model as trained at the global weights ``state``: the row's unmodified model with the
        federation's weights (block 0's norm1, which the surgery removed, keeps its checkpoint or
        seeded values)."""
        if self.acc_model is None:  # finish_round calls it only for a row with an unmodified model
            raise RuntimeError(f"model row {self.row.name!r} has no unmodified model (acc_model)")
        result = self.acc_model.load_state_dict(state, strict=False)
        removed = [k for k in result.missing_keys if not k.startswith("blocks.0.norm1.")]
        if removed or result.unexpected_keys:
            raise RuntimeError(f"model row {self.row.name!r}: the unmodified model does not take the federation's "
                               f"weights (missing {removed}, unexpected {result.unexpected_keys})")
        return self.acc_model.eval()

    def record_error(self, attack: str, rnd: int, part: int, text: str) -> None:
        """Write an unexpected attack error's traceback to ``errors/`` of the run folder."""
        path = self.run_folder.write_error(f"{slug(self.row.name)}__{self.group}__{slug(attack)}__r{rnd}-p{part}.txt",
                                           text)
        _logger.error("%s/%s: attack %s raised an unexpected error (round %d, partition %d); traceback in %s",
                      printable(self.row.name), self.group, printable(attack), rnd, part, printable(path))

    def record_client_failures(self, result: Any) -> None:
        """Updates that never reached the attacker (a client raised, timed out or sent a malformed
        reply): their rows (:func:`benchmark.rows.client_failure_rows`), so the table counts them
        and a resumed run does not wait for them. The server does not know a failed client's
        partition; the missing (round, partition) pairs are what was expected and not tapped. A
        federation where no update reached the attacker at all is an error."""
        failures = list(getattr(result, "failures", None) or [])
        clients = self.cfg.federation.clients
        for f in failures:
            _logger.warning("%s/%s: round %d, node %d: %s", printable(self.row.name), self.group, f.server_round,
                            f.node_id, printable(f.reason))
        rows = []
        attackers = [(a.label, a.name) for a in self.p.attackers]
        for rnd, part in self.rounds.missing():
            reasons = sorted({f.reason for f in failures if f.server_round == rnd and f.partition_id in (None, part)})
            if rnd in self.partial_aggregates:
                covered = self.partial_aggregates[rnd]
                dropped = sorted(set(range(clients)) - set(covered))
                reasons.append(f"SecAgg+ dropout: the aggregate covers partitions {covered} of {clients}, partitions "
                               f"{dropped} dropped out")
            batch = tapped_batch(self.resolved, part, rnd, clients)
            rows += [r for r in client_failure_rows(self.ctx, rnd, part, batch, reasons, attackers, self.settings)
                     if r.key not in self.done]
        if rows:
            self.run_folder.append(rows)
            self.done.update(r.key for r in rows)
            self.new_rows += len(rows)
            self.failed_rows += len(rows)
            self.client_failed_rows += len(rows)
        # (an aggregate that missed dropped clients reached the server: its round's rows are failed above)
        if not self.rounds.seen and not self.partial_aggregates and self.rounds.wanted:
            counts = Counter(f.reason for f in failures)
            listed = "; ".join(f"{reason} ({n} update(s))" for reason, n in counts.most_common(3))
            more = f"; and {len(counts) - 3} other reason(s)" if len(counts) > 3 else ""
            raise FederationFailed(f"model row {self.row.name!r} ({self.group}): no client update reached the "
                                   f"attacker: {listed or 'no client answered'}{more}")
