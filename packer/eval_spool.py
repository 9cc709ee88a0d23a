"""The packer's durable record of online evaluation, ``RUN_DIR/packer/eval.bin`` (the record framing of
:mod:`packer.spool`, never compacted), from which a restarted or resumed packer rebuilds its
:class:`packer.evaluation.EvalAggregator` and its closed rounds' results. Kinds, all fsynced:
``group`` (``[round, size, id, task, rewards, lens, terms, vmin, vmax]``: a received group's summary,
before its release; one fsync per burst), ``failed`` (new failed ids), ``closed`` (``[round, [EvalResult
frames]]``, before publication, so a restart publishes the same results, never recomputed), ``reset``
(a resume at checkpoint ``round``: later rounds forgotten). Replay goes through the aggregator's own
methods; a round complete but not yet ``closed`` is closed on replay; a damaged tail ends the replay.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from bus.codec import decode, encode
from bus.eval_ids import parse_eval_id
from bus.messages import EvalResult, ScoredGroup
from packer.evaluation import EvalAggregator, EvalGroup, RoundResult, summarize
from packer.spool import RecordLog, open_for_append, replay_records

log = logging.getLogger(__name__)

EVAL_SPOOL_NAME = "eval.bin"
"""The eval spool's file name in the packer's spool directory."""


class EvalSpool:
    """The eval spool in ``directory`` (created if missing), replayed into ``aggregator`` on open.

    Attributes:
        results: the closed rounds' results, by round (published again after a restart).
        closed_on_replay: rounds complete on replay without a ``closed`` record: close and publish them.
        torn_records: damaged tails dropped on opening (0 or 1).
    """

    def __init__(self, directory: str | os.PathLike[str], aggregator: EvalAggregator) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / EVAL_SPOOL_NAME
        self.aggregator = aggregator
        self.results: dict[int, list[EvalResult]] = {}
        self.closed_on_replay: list[RoundResult] = []
        self.torn_records = 0
        good = self._replay() if self.path.is_file() else 0
        self.log = RecordLog(open_for_append(self.path, good))

    def taken(self, group: ScoredGroup, *, sync: bool = True) -> None:
        """Record a received eval group, fsynced (``sync=False``: flushed; ``log.sync()`` before releasing it)."""
        s = summarize(group)
        self._write(
            "group",
            [
                group.eval_round,
                group.eval_size,
                group.id,
                group.task,
                s.rewards.tolist(),
                s.completion_lens.tolist(),
                s.reward_terms,
                s.version_min,
                s.version_max,
            ],
            sync=sync,
        )

    def failed(self, group_ids: list[str]) -> list[str]:
        """Record (fsynced) and return the ids of ``group_ids`` that are new failures of open rounds."""
        new = [g for g in dict.fromkeys(group_ids) if self.aggregator.is_new_failure(g)]
        if new:
            self._write("failed", new)
        return new

    def closed(self, result: RoundResult) -> None:
        """Record a closed round's results (fsynced: before publishing them)."""
        self._write("closed", [result.round, [[bytes(f) for f in encode(r)] for r in result.results]])
        self.results[result.round] = list(result.results)

    def reset_above(self, round_: int) -> None:
        """Forget every round ``> round_`` (a resume at checkpoint step ``round_``); fsynced."""
        if any(r > round_ for r in [*self.aggregator.rounds, *self.aggregator.closed]):
            self._write("reset", int(round_))
            self._apply("reset", int(round_))

    def close(self) -> None:
        """Flush and close the file."""
        self.log.close()

    def _write(self, kind: str, body: Any, *, sync: bool = True) -> None:
        """Append one record; the caller applies it to the live aggregator itself."""
        self.log.append(kind, body, sync=sync)

    def _apply(self, kind: str, body: Any) -> None:
        """Apply one record read back to the aggregator and :attr:`results`."""
        agg = self.aggregator
        if kind == "group":
            r, size, gid, task, rewards, lens, terms, vmin, vmax = body
            if int(r) in agg.closed:
                return
            summary = EvalGroup(
                np.asarray(rewards, np.float64),
                np.asarray(lens, np.int64),
                {str(k): list(map(float, v)) for k, v in terms.items()},
                int(vmin),
                int(vmax),
            )
            done = agg.take(int(r), int(size), str(gid), str(task), summary)
            if done is not None:
                self.closed_on_replay.append(done)
        elif kind == "failed":
            self.closed_on_replay += agg.add_failed([str(g) for g in body if parse_eval_id(str(g)) is not None])
        elif kind == "closed":
            r = int(body[0])
            results = [decode(frames) for frames in body[1]]
            if not all(isinstance(x, EvalResult) for x in results):
                raise ValueError(f"eval spool: closed record of round {r} holds a non-EvalResult")
            agg.rounds.pop(r, None)
            agg.closed.add(r)
            self.closed_on_replay = [c for c in self.closed_on_replay if c.round != r]
            self.results[r] = results
        elif kind == "reset":
            agg.forget_above(int(body))
            self.results = {r: v for r, v in self.results.items() if r <= int(body)}
            self.closed_on_replay = [c for c in self.closed_on_replay if c.round <= int(body)]
        else:
            raise ValueError(f"unknown eval spool record kind {kind!r}")

    def _replay(self) -> int:
        """Apply every intact record; returns the offset after the last one."""
        offset, torn = replay_records(self.path, lambda kind, body, _size: self._apply(kind, body), "eval spool")
        self.torn_records += torn
        return offset
