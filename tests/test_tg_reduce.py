"""Join reductions (treegen.lang.reduce): answers, votes, scores, best-of-N, top-k; ties go to the first branch."""

import math
import re

import pytest

from treegen.lang.reduce import best, collect, extract, ranking, score, tally, top_k, vote


def test_extract():
    assert extract("  42 \n") == "42"
    assert extract("The answer is 4. No wait, the answer is 5.", r"answer is (\d+)") == "5"  # the last match
    assert extract("x = 12 and y = 7", r"\d+") == "7"  # no group: the whole match
    assert extract("nothing here", r"answer is (\d+)") is None
    assert extract("   ", None) is None and extract(None, r"x") is None
    assert extract("Answer: B", re.compile(r"Answer: ([A-D])")) == "B"
    assert extract("abc", lambda t: t.upper()) == "ABC"
    with pytest.raises(TypeError, match="extract expects text"):
        extract(["a"], None)


def test_vote_counts_answers_and_breaks_ties_by_branch_order():
    texts = ["so 3. The answer is 3.", "The answer is 4", "I get 4. The answer is 4.", "no idea", "The answer is 3"]
    assert tally(texts, r"answer is (\d+)") == {"3": 2, "4": 2}
    assert vote(texts, r"answer is (\d+)") == "3"  # 2 vs 2: "3" was seen first
    assert vote(texts[1:], r"answer is (\d+)") == "4"
    assert vote(["b", "a", "a", "b"]) == "b"
    assert vote(["b", " a", "a ", "b"][1:]) == "a"  # answers are stripped before counting
    assert vote(["no", "answers"], r"(\d+)") is None and vote([]) is None


@pytest.mark.parametrize("value,expected", [
    (3, 3.0), (2.5, 2.5), (" 7", 7.0), ("Score: 8/10", 8.0), ("-1.5 points", -1.5), ("none", -math.inf),
    (None, -math.inf), (float("nan"), -math.inf),
])
def test_score(value, expected):
    assert score(value) == expected


def test_score_rejects_other_types():
    with pytest.raises(TypeError, match="a score must be a number or text"):
        score(["1"])
    with pytest.raises(TypeError, match="cannot be a bool"):
        score(True)


def test_best_and_top_k_are_stable():
    values = ["a", "b", "c", "d", "e"]
    scores = ["2", "5", "bad", "5", 1]
    assert ranking(scores) == [1, 3, 0, 4, 2]
    assert best(values, scores) == "b"  # b and d tie at 5: b comes first
    assert top_k(values, scores, 2) == ["b", "d"]
    assert top_k(values, scores, 3) == ["b", "d", "a"]
    assert top_k(values, scores, 10) == ["b", "d", "a", "e", "c"]
    assert best(["x", "y"], ["none", "none"]) == "x"  # nothing scores: the first
    assert collect(iter("ab")) == ["a", "b"]


def test_best_and_top_k_validate():
    with pytest.raises(ValueError, match="2 values but 3 scores"):
        best(["a", "b"], [1, 2, 3])
    with pytest.raises(ValueError, match="no values"):
        best([], [])
    with pytest.raises(ValueError, match="k must be an integer >= 1, got 0"):
        top_k(["a"], [1], 0)
