"""Tasks: one module per task holds its dataset (loading or generation), prompt rendering, reward
function(s) and eval split: :mod:`tasks.reverse_text`, :mod:`tasks.gsm8k` (data in
``tasks/data/gsm8k/``), :mod:`tasks.countdown`.

Shared pieces: :mod:`tasks.task` (the :class:`Task` type, splits, prompt rendering),
:mod:`tasks.registry` (task names and the custom-task hook ``task.name: package.module:function``,
eval tasks, the reward spec), :mod:`tasks.rewards` (reward names and import paths),
:mod:`tasks.import_path` (resolving ``"package.module:function"``) and :mod:`tasks.datasets`
(local JSONL/Parquet files with a field mapping).

Any stage may import this package; it imports no stage package. ``from tasks import Task`` is the
type a custom task function returns. Importing the package is light (no configs, no math-verify).
"""

from tasks.task import Task

__all__ = ["Task"]
