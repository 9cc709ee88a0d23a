"""Online evaluation rounds: which policy versions are evaluated, on what, and when each round is
issued by the prompt source.

Rounds. With ``eval.enabled`` the evaluated policy versions are
``{0 if eval.eval_base_model} + {k * eval.interval : 0 < k * interval < max_steps} + {max_steps}``
(``interval == 0``: only the end). Round ``r`` is the policy after ``r`` optimizer steps; round 0
is the unmodified base model. With ``eval.only`` (``busctl eval``, no training) round 0 alone.

Issue. Round ``r`` is issued once the gate's ``policy_version`` (the version every live producer
runs, :class:`prompts.applied_versions.AppliedVersions`) is ``>= r``, all its prompts at once: for
every eval task (``tasks.registry.eval_tasks``) its first ``num_examples`` held-out examples
(``get_task(name, cfg.task).load("eval", num_examples, seed)``, rendered with that task's system
prompt), ids ``e{r:06d}-{task}-{i:05d}`` (:mod:`bus.eval_ids`), ``eval_round = r``,
``eval_size`` = prompts in the whole round, ``step = r``, ``index`` = position in the round (so a
sampling seed gives every round the same random numbers: rounds compare with less noise). Eval
prompts are not ledger prompts: they count towards no step, and their outcomes (``groups.dropped``
of an eval id) are not the ledger's (the packer counts them towards the round,
:mod:`packer.evaluation`).

Journal and recovery. A queued round is journaled in the prompt source's ledger as a note
``{"event": "eval_round", "round": r}``; once the packer's ``eval.result`` of every eval task of
round ``r`` has been seen, ``{"event": "eval_done", "round": r}``. A restarted source (supervisor)
skips the rounds journaled done and issues again, all prompts with the same ids, every round
journaled issued but not done: its prompts may have died with the old source's outbox, and the
packer counts each id once (a copy of a received group is a duplicate; a round it already closed
answers with its stored result). A resumed run (``busctl up --resume``, trainer checkpoint at step
``c``) also forgets every round ``> c``, done or not: the trainer drops their records (they
evaluated the lost lineage) and they are issued again when the producers reach version ``r``.

Which policy a re-issued round scores: the version the producers run when its prompts are sampled
again, ``>= r`` (after a resume: the checkpoint's ``c >= r``); groups received before the restart
keep the version they were sampled under. The round is still reported as round ``r``; its
``eval.result`` ``version_min``/``version_max`` (metrics.jsonl ``eval/<task>/version_min|max``)
give the versions actually sampled, and the packer logs them.

That a round is sampled under exactly the version ``r`` (when the producers are not already past
it) is the producers' side: a weight update waits for in-flight eval requests
(:class:`producers.eval_gate.EvalUpdateGate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bus.eval_ids import eval_prompt_id
from bus.messages import Prompt
from prompts.temperature import eval_temperature
from tasks.registry import eval_tasks, get_task, load_task_examples
from tasks.task import render_messages

if TYPE_CHECKING:
    from configs.schema import EvalConfig, RunConfig


def eval_round_versions(eval_cfg: "EvalConfig", max_steps: int) -> list[int]:
    """The policy versions evaluated in a run (module docstring), ascending; [] when disabled.

    Raises:
        ValueError: ``max_steps < 1``.
    """
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    if not eval_cfg.enabled:
        return []
    if eval_cfg.only:  # busctl eval: the policy at model.path, no training
        return [0]
    rounds = {max_steps}
    if eval_cfg.eval_base_model:
        rounds.add(0)
    if eval_cfg.interval > 0:
        rounds.update(range(eval_cfg.interval, max_steps, eval_cfg.interval))
    return sorted(rounds)


@dataclass(frozen=True)
class EvalSet:
    """One eval task's held-out prompts: name, system prompt, examples ``{"id", "prompt", "info"}``."""

    task: str
    system_prompt: str | None
    examples: list[dict[str, Any]]


class EvalRounds:
    """Which eval rounds are due and their prompts.

    Args:
        rounds: policy versions to evaluate (:func:`eval_round_versions`).
        sets: the eval tasks' held-out prompts; every round uses all of them.
        temperature: sampling temperature of eval prompts (> 0).
        done: rounds whose results were seen (from the journal): never issued again. Every other
            round is issued when due, also one issued before a restart (module docstring).

    Raises:
        ValueError: rounds without eval prompts, or temperature <= 0.
    """

    def __init__(
        self, rounds: list[int], sets: list[EvalSet], *, temperature: float, done: set[int] = frozenset()
    ) -> None:
        if rounds and not any(s.examples for s in sets):
            raise ValueError("eval rounds are configured but the eval tasks have no held-out examples")
        if not temperature > 0:
            raise ValueError(f"eval temperature must be > 0, got {temperature}")
        self.rounds = sorted(set(rounds))
        self.sets = sets
        self.temperature = float(temperature)
        self.issued: set[int] = set(done)
        self.done: set[int] = set(done)
        self.results: dict[int, set[str]] = {}  # round -> eval tasks whose result was seen

    @property
    def tasks(self) -> set[str]:
        """The eval tasks that report a result every round (those with held-out examples)."""
        return {s.task for s in self.sets if s.examples}

    def on_result(self, round_: int, task: str) -> bool:
        """Note the packer's ``eval.result`` of ``(round_, task)``; True if it completes the round
        (every task of :attr:`tasks` seen) for the first time: journal it done."""
        if round_ in self.done or round_ not in self.rounds:
            return False
        seen = self.results.setdefault(round_, set())
        seen.add(task)
        if not self.tasks <= seen:
            return False
        self.done.add(round_)
        self.issued.add(round_)
        self.results.pop(round_, None)
        return True

    def restore(self, notes: list[dict[str, Any]], resume_step: int | None = None) -> list[int]:
        """Rebuild from the ledger's journal notes (oldest first): rounds journaled done are never
        issued again; returns the rounds journaled issued but not done (issued again when due).

        A ``start`` note with ``resume`` and ``checkpoint_step: c`` (a past resume), and
        ``resume_step`` (this one), forget the rounds ``> c`` noted before them (module docstring).
        """
        issued: set[int] = set()
        done: set[int] = set()
        for n in [*notes, {"event": "start", "resume": True, "checkpoint_step": resume_step}]:
            event = n.get("event")
            if event == "eval_round":
                issued.add(int(n["round"]))
            elif event == "eval_done":
                done.add(int(n["round"]))
            elif event == "start" and n.get("resume") and n.get("checkpoint_step") is not None:
                c = int(n["checkpoint_step"])
                issued, done = {r for r in issued if r <= c}, {r for r in done if r <= c}
        self.done |= done
        self.issued |= done
        return sorted(issued - done)

    @property
    def round_size(self) -> int:
        """Prompts (groups) in one round, all eval tasks."""
        return sum(len(s.examples) for s in self.sets)

    def due(self, policy_version: int) -> list[int]:
        """Rounds not issued yet with ``round <= policy_version``, ascending."""
        return [r for r in self.rounds if r <= policy_version and r not in self.issued]

    def issue(self, round_: int) -> list[Prompt]:
        """Mark ``round_`` issued and return its prompts (raises ValueError if not a pending round)."""
        if round_ not in self.rounds or round_ in self.issued:
            raise ValueError(f"eval round {round_} is not pending (rounds {self.rounds}, issued {sorted(self.issued)})")
        self.issued.add(round_)

        size, prompts = self.round_size, []
        for s in self.sets:
            for i, ex in enumerate(s.examples):
                prompts.append(
                    Prompt(
                        id=eval_prompt_id(round_, s.task, i),
                        index=len(prompts),
                        step=round_,
                        task=s.task,
                        messages=render_messages(ex, s.system_prompt),
                        info=dict(ex["info"]),
                        temperature=self.temperature,
                        eval_round=round_,
                        eval_size=size,
                    )
                )
        return prompts


def build_eval_rounds(cfg: "RunConfig", done: set[int] = frozenset()) -> EvalRounds:
    """The run's :class:`EvalRounds`: rounds from ``cfg.eval`` and ``trainer.max_steps``, each eval
    task's held-out examples (its ``eval`` split) and :func:`prompts.temperature.eval_temperature`."""

    rounds = eval_round_versions(cfg.eval, cfg.trainer.max_steps)
    sets = []
    for et in eval_tasks(cfg) if rounds else []:
        task = get_task(et.name, cfg.task)
        sets.append(EvalSet(et.name, task.system_prompt, load_task_examples(task, "eval", et.num_examples, et.seed)))
    return EvalRounds(rounds, sets, temperature=eval_temperature(cfg), done=done)
