"""Reward functions of the custom-task example: one written for TRL's GRPOTrainer, one in rlbus's own form.

Both read the dataset's ``ground_truth`` column: TRL-style functions get every column as a keyword argument
(a list, one entry per completion), rlbus functions in ``info``.
"""

import difflib


def exact_match(completions, ground_truth, **kwargs):
    """TRL-style (``trl:my_rewards:exact_match``): 1.0 where the completion is the reversed word."""
    return [1.0 if c.strip() == gt else 0.0 for c, gt in zip(completions, ground_truth)]


def similarity(completion, info):
    """rlbus-style (``my_rewards:similarity``): how close the completion is to the reversed word, in [0, 1]."""
    return difflib.SequenceMatcher(None, completion.strip(), info["ground_truth"]).ratio()
