"""The TRL arm of :mod:`bench.vs_trl`: TRL's ``GRPOTrainer`` on rlbus's job, in its own process.

Usage (``bench.vs_trl`` starts it; needs the ``bench`` extra, ``trl==1.16.0``)::

    python -m bench.trl_arm --policy DIR --events FILE --out-dir DIR [--config YAML] [--steps N]
        [--eval-every K] [--threads 2]

The job comes from the rlbus config, so both arms share it: the policy rlbus built, the task's train split in
order rendered as rlbus's producers render it, the task's weighted reward functions, the batch, group size,
sampling and optimizer settings, no KL. TRL's ``dapo`` loss with one optimizer step per batch has ratio 1, so its
gradient is rlbus's default ``aipo`` with ``token_mean``; TRL's advantages divide by the sample std, rlbus's by
the population std (smaller by ``sqrt((G-1)/G)``). Eval runs as a callback on the config's eval tasks. Output:
one JSON event per step and eval in ``--events`` (format: :mod:`bench.vs_trl_stats`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.trl_arm", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="rlbus config (default configs/reverse_text.yaml)")
    ap.add_argument("--policy", required=True, help="policy directory (HF format)")
    ap.add_argument("--events", required=True, help="JSON-lines file of step and eval events")
    ap.add_argument("--out-dir", required=True, help="TRL output_dir (nothing is saved there)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default trainer.max_steps)")
    ap.add_argument("--eval-every", type=int, default=25, help="eval every this many steps (0: start and end only)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    return ap.parse_args(argv)


class _EventLog:
    """Appends events to a JSON-lines file, one flushed line each."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", encoding="utf-8")

    def write(self, event: dict[str, Any]) -> None:
        self.file.write(json.dumps(event) + "\n")
        self.file.flush()


def _combined_reward(terms: list[tuple[Any, float]], completion: str, info: dict) -> float:
    """``sum(weight * fn(completion, info))`` over the task's reward terms (rlbus's weighted sum)."""
    return sum(weight * float(fn(completion, info)) for fn, weight in terms)


def _trl_reward_fn(fn: Any, name: str, log: dict[str, int]) -> Any:
    """One rlbus reward function as a TRL reward function (conversational completions).

    ``log`` accumulates the real token counts of the batch TRL scores (completion ids, prompt
    lengths of the ``prompt_tokens`` column), read by the step callback.
    """

    def reward(
        prompts: list, completions: list, completion_ids: list, info_json: list[str], prompt_tokens: list[int], **_: Any
    ) -> list[float]:
        log["completion_tokens"] = sum(len(ids) for ids in completion_ids)
        log["num_tokens"] = log["completion_tokens"] + sum(prompt_tokens)
        return [float(fn(c[-1]["content"], json.loads(i))) for c, i in zip(completions, info_json, strict=True)]

    reward.__name__ = name
    return reward


def main(argv: list[str] | None = None) -> int:
    """Run the TRL arm (see the module docstring); returns the exit status."""
    ns = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(ns.threads))
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from configs.schema import load_config
    from tasks.registry import eval_tasks, get_task, load_task_examples
    from tasks.rewards import get_reward_fn, reward_name
    from tasks.task import render_messages

    torch.set_num_threads(ns.threads)
    cfg = load_config(ns.config)
    steps = ns.steps or cfg.trainer.max_steps
    group, batch = cfg.producers.group_size, cfg.trainer.batch_size
    events = _EventLog(Path(ns.events))
    tokenizer = AutoTokenizer.from_pretrained(ns.policy)
    model = AutoModelForCausalLM.from_pretrained(ns.policy, dtype=torch.float32)

    task = get_task(cfg.task.name, cfg.task)

    def prompt_len(messages: list[dict]) -> int:
        return len(
            tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )

    rows = []
    for ex in load_task_examples(task, "train", steps * batch // group, cfg.task.seed):
        messages = render_messages(ex, task.system_prompt)
        rows.append({"prompt": messages, "info_json": json.dumps(ex["info"]), "prompt_tokens": prompt_len(messages)})
    dataset = Dataset.from_list(rows)
    token_log: dict[str, int] = {}
    reward_funcs = [_trl_reward_fn(get_reward_fn(ref), reward_name(ref), token_log) for ref, _ in task.rewards]
    weights = [w for _, w in task.rewards]

    eval_sets = []
    for et in eval_tasks(cfg):
        et_task = get_task(et.name, cfg.task)
        examples = load_task_examples(et_task, "eval", et.num_examples, et.seed) * et.rollouts_per_example
        terms = [(get_reward_fn(ref), w) for ref, w in et_task.rewards]
        eval_sets.append((et.name, examples, [render_messages(ex, et_task.system_prompt) for ex in examples], terms))

    opt = cfg.trainer.optim
    args = GRPOConfig(
        output_dir=ns.out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=group,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=cfg.sampling.max_tokens,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        top_k=0,
        learning_rate=opt.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        max_grad_norm=opt.max_grad_norm,
        optim="adamw_torch",
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        reward_weights=weights,
        shuffle_dataset=False,
        seed=cfg.trainer.seed,
        logging_steps=10,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        eval_strategy="no",
    )

    class Probe(TrainerCallback):
        """Step events, and the eval rounds (before step 1, every ``--eval-every``, after the last)."""

        def __init__(self) -> None:
            self.trainer: Any = None

        def evaluate(self, step: int) -> None:
            m = self.trainer.model
            was_training = m.training
            m.eval()
            for name, examples, conversations, terms in eval_sets:
                texts = [
                    tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations
                ]
                enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
                with torch.no_grad():
                    out = m.generate(**enc, generation_config=self.trainer.generation_config)
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                rewards = [_combined_reward(terms, text, ex["info"]) for text, ex in zip(texts, examples, strict=True)]
                events.write(
                    {
                        "t": time.time(),
                        "kind": "eval",
                        "step": step,
                        "task": name,
                        "reward_mean": sum(rewards) / len(rewards),
                    }
                )
            m.train(was_training)

        def on_train_begin(self, args, state, control, **kw):
            self.evaluate(0)

        def on_step_end(self, args, state, control, **kw):
            step = state.global_step
            events.write(
                {
                    "t": time.time(),
                    "kind": "step",
                    "step": step,
                    "num_tokens": token_log.get("num_tokens"),
                    "completion_tokens": token_log.get("completion_tokens"),
                }
            )
            if step == steps or (ns.eval_every and step % ns.eval_every == 0):
                self.evaluate(step)

    probe = Probe()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[probe],
    )
    probe.trainer = trainer
    trainer.train()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
