"""Online evaluation rounds: which policy versions are evaluated, their prompts, and their journal.

Round ``r`` (the policy after ``r`` steps; 0 the base model) is issued once the gate's
``policy_version >= r``: every eval task's first ``num_examples`` held-out examples, ids from
:func:`bus.eval_ids.eval_prompt_id`. Eval prompts are not ledger prompts. Rounds are journaled as
ledger notes ``eval_round`` and, once every task's ``eval.result`` was seen, ``eval_done``; a
restarted source issues again the rounds without ``eval_done``, and a resume at checkpoint ``c``
forgets rounds ``> c``. The story: docs/ARCHITECTURE.md, "Producer side".
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
    """:meth:`configs.rollout.EvalConfig.round_versions` (the producers hold weight updates by the same list)."""
    return eval_cfg.round_versions(max_steps)


@dataclass(frozen=True)
class EvalSet:
    """One eval task's held-out examples and system prompt."""

    task: str
    system_prompt: str | None
    examples: list[dict[str, Any]]


class EvalRounds:
    """Which of ``rounds`` are due, and their prompts (all of ``sets``); ``done`` rounds are never issued.
    ValueError for rounds without eval prompts or ``temperature <= 0``."""

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
        """The eval tasks with held-out examples (each reports every round)."""
        return {s.task for s in self.sets if s.examples}

    def on_result(self, round_: int, task: str) -> bool:
        """Note ``(round_, task)``'s result; True when it completes the round for the first time."""
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
        """Restore from the journal's notes; returns the rounds issued but not done. A resume at ``c`` (a
        ``start`` note's ``checkpoint_step``, or ``resume_step``) forgets the rounds ``> c`` before it."""
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

    def finish_at(self, step: int) -> None:
        """The run now ends after ``step``: rounds past it go, ``step`` becomes the final round (when there
        are rounds at all)."""
        if self.rounds:
            self.rounds = sorted({r for r in self.rounds if r < step} | {step})

    @property
    def round_size(self) -> int:
        """Prompts in one round."""
        return sum(len(s.examples) for s in self.sets)

    def due(self, policy_version: int) -> list[int]:
        """Rounds not issued with ``round <= policy_version``, ascending."""
        return [r for r in self.rounds if r <= policy_version and r not in self.issued]

    def issue(self, round_: int) -> list[Prompt]:
        """Mark ``round_`` issued and return its prompts (``index``: position in the round, so a sampling
        seed gives every round the same random numbers). ValueError unless the round is pending."""
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
    """The run's :class:`EvalRounds` (each eval task's ``eval`` split)."""

    rounds = eval_round_versions(cfg.eval, cfg.trainer.max_steps)
    sets = []
    for et in eval_tasks(cfg) if rounds else []:
        task = get_task(et.name, cfg.task)
        sets.append(EvalSet(et.name, task.system_prompt, load_task_examples(task, "eval", et.num_examples, et.seed)))
    return EvalRounds(rounds, sets, temperature=eval_temperature(cfg), done=done)
