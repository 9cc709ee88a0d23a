"""The prompt source component: issues the task's prompts onto ``prompts``, paced by the policy
version the producers run, and keeps the run's accounting of every issued prompt.

Modules: :mod:`prompts.source` (the socket-free :class:`~prompts.source.PromptSource`),
:mod:`prompts.proc` (its process, ``python -m prompts.proc``), :mod:`prompts.accounting` (the
ledger of issued prompts and their outcomes, journaled), :mod:`prompts.applied_versions` (the
producers' applied versions, the gate), :mod:`prompts.eval_rounds` (online evaluation rounds)
and :mod:`prompts.temperature` (the sampling temperature each prompt carries).

A stage package: it imports bus, configs and tasks, no other stage.
"""
