"""Reductions of joined branches: collect, majority vote, best-of-N by a score, top-k.

After a join a variable holds one value per branch, in branch order (``s["answer"]`` in the Python
DSL, ``answer`` after ``join`` in a ``.tg`` file). These functions reduce such lists. They are
deterministic: **ties go to the first value in branch order**.

    >>> vote(["The answer is 4.", "I think 5. The answer is 5.", "The answer is 5"], extract=r"answer is (\\d+)")
    '5'
    >>> best(["a", "b", "c"], scores=[" 3", "7", "Score: 7"])   # scores may be text: first number in it
    'b'
    >>> top_k(["a", "b", "c"], scores=[1, 3, 2], k=2)
    ['b', 'c']
"""

from __future__ import annotations

import math
import re
from typing import Callable, Sequence

Extractor = str | re.Pattern | Callable[[str], str | None] | None
"""How an answer is found in a text: see :func:`extract`."""
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def collect(values: Sequence) -> list:
    """The values as a list, in branch order."""
    return list(values)


def extract(text: str | None, pattern: Extractor = None) -> str | None:
    """The answer in ``text``, stripped of surrounding whitespace; None when there is none.

    ``pattern``: None (the whole text), a regular expression (its **last** match in the text, the
    final answer when a text states several; group 1 when the pattern has a group, else the whole
    match), or a function ``text -> answer or None``. An empty answer counts as none.
    """
    if text is None:
        return None
    if not isinstance(text, str):
        raise TypeError(f"extract expects text, got {type(text).__name__} {text!r:.60}")
    if pattern is None:
        answer = text
    elif callable(pattern) and not isinstance(pattern, re.Pattern):
        answer = pattern(text)
    else:
        regex = re.compile(pattern)
        matches = list(regex.finditer(text))
        if not matches:
            return None
        last = matches[-1]
        answer = last.group(1) if regex.groups else last.group(0)
    answer = answer.strip() if answer is not None else None
    return answer or None


def tally(values: Sequence[str | None], extract: Extractor = None) -> dict[str, int]:
    """Votes per answer, in order of first appearance; values without an answer do not vote."""
    counts: dict[str, int] = {}
    for v in values:
        answer = _extract(v, extract)
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
    return counts


def vote(values: Sequence[str | None], extract: Extractor = None) -> str | None:
    """The most frequent answer (see :func:`extract`); ties go to the answer seen first; None when no
    value has an answer."""
    counts = tally(values, extract)
    return max(counts, key=counts.__getitem__) if counts else None  # max keeps the first of equals


_extract = extract


def score(value) -> float:
    """A value as a number: numbers as they are, text by the first number written in it
    (``" 7"``, ``"Score: 7/10"`` -> 7.0); anything else (no number, None, NaN) ranks lowest, ``-inf``."""
    if isinstance(value, bool):
        raise TypeError(f"a score cannot be a bool, got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        m = _NUMBER.search(value)
        number = float(m.group()) if m else -math.inf
    elif value is None:
        number = -math.inf
    else:
        raise TypeError(f"a score must be a number or text, got {type(value).__name__} {value!r:.60}")
    return -math.inf if math.isnan(number) else number


def ranking(scores: Sequence) -> list[int]:
    """Branch indices from the highest score to the lowest; equal scores keep branch order."""
    keys = [score(s) for s in scores]
    return sorted(range(len(keys)), key=lambda i: -keys[i])  # sorted is stable


def _check(values: Sequence, scores: Sequence, what: str) -> None:
    if len(values) != len(scores):
        raise ValueError(f"{what}: {len(values)} values but {len(scores)} scores; "
                         "they must come from the same branches")
    if not values:
        raise ValueError(f"{what}: no values")


def best(values: Sequence, scores: Sequence):
    """Best-of-N: the value with the highest score (see :func:`score`); ties go to the first."""
    _check(values, scores, "best")
    return values[ranking(scores)[0]]


def top_k(values: Sequence, scores: Sequence, k: int) -> list:
    """The ``k`` values with the highest scores, best first; ties in branch order. ``k`` may exceed
    the number of values (all are returned)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"top_k: k must be an integer >= 1, got {k!r}")
    _check(values, scores, "top_k")
    return [values[i] for i in ranking(scores)[:k]]


__all__ = ["best", "collect", "extract", "ranking", "score", "tally", "top_k", "vote"]
