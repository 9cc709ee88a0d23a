"""Tasks: one module per built-in task (dataset, prompt, reward functions, eval split), the
:class:`Task` type (:mod:`tasks.task`), the registry and custom-task hook (:mod:`tasks.registry`),
reward references (:mod:`tasks.rewards`) and local dataset files (:mod:`tasks.datasets`).

A library: any stage may import it, it imports no stage; importing it is light (no math-verify).
"""

from tasks.task import Task

__all__ = ["Task"]
