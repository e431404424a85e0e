"""Reductions at a join (vote, best, top_k, concat) as program nodes: values, tie rules, the compiled
tree, log-probability scores against Hugging Face, and errors."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import treegen
from treegen.lang import reduce
from treegen.lang.ir import Reduce

FEW_SHOT = "Q: 2 + 2?\nA: The answer is 4.\n\nQ: 3 + 5?\nA: The answer is 8.\n\n"


@treegen.program
def voting(s, n):
    s += FEW_SHOT + "Q: 4 + 3?\nA:"
    b = s.fork(n)
    b += treegen.gen("reasoning", max_tokens=10, stop="\n", temperature=1.0)
    s.join(b, answer=treegen.vote("reasoning", extract=r"answer is (-?\d+)"),
           longest=treegen.best("reasoning", by=len), shortest2=treegen.top_k("reasoning", by=lambda t: -len(t), k=2),
           likeliest=treegen.best("reasoning", by="logprob"), transcript=treegen.concat("reasoning", sep=" | "))


def test_reductions_compute_from_the_joined_values(smol):
    s = voting.run(smol, 6, seed=5)
    texts = s["reasoning"]
    answers = [reduce.extract(t, r"answer is (-?\d+)") for t in texts]
    assert s["answer"] == reduce.vote(texts, r"answer is (-?\d+)")
    assert s.info["answer"] == {"reduction": "vote", "source": "reasoning", "branches": 6,
                                "votes": reduce.tally(texts, r"answer is (-?\d+)"),
                                "winners": [i for i, a in enumerate(answers) if a is not None and a == s["answer"]]}
    assert s["longest"] == max(texts, key=len)  # max keeps the first of equal lengths, as the rule says
    longest = max(range(6), key=lambda i: (len(texts[i]), -i))
    assert s.info["longest"] == {"reduction": "best", "source": "reasoning", "branches": 6,
                                 "scores": [float(len(t)) for t in texts], "winners": [longest]}
    assert s["shortest2"] == sorted(texts, key=len)[:2]  # sorted is stable: ties in branch order
    assert s.info["shortest2"]["winners"] == sorted(range(6), key=lambda i: len(texts[i]))[:2]
    assert s.info["shortest2"]["scores"] == [-float(len(t)) for t in texts]
    lps = [st.info["reasoning"]["logprob"] for st in s._run.states[1:]]
    assert s["likeliest"] == texts[max(range(len(lps)), key=lambda i: (lps[i], -i))]
    assert s.info["likeliest"]["scores"] == lps
    assert s["transcript"] == " | ".join(texts)
    assert s.info["transcript"] == {"reduction": "concat", "source": "reasoning", "branches": 6}


def test_the_compiled_tree_shows_the_reductions(smol):
    tree = voting.compile(3, tokenizer=smol.tokenizer).tree
    recorded = tree.graph.nodes[0]["reductions"]
    assert [(r["name"], r["kind"], r["source"], r["by"]) for r in recorded] == [
        ("answer", "vote", "reasoning", None), ("longest", "best", "reasoning", "len"),
        ("shortest2", "top_k", "reasoning", "<lambda>"), ("likeliest", "best", "reasoning", "logprob"),
        ("transcript", "concat", "reasoning", None)]


def test_logprob_scores_are_the_models_own(smol, hf_smol):
    @treegen.program
    def greedy(s):
        s += FEW_SHOT
        b = s.fork(2, content=["Q: 1 + 1?\nA:", "Q: 6 + 1?\nA:"])
        b += treegen.gen("x", max_tokens=6)
        s.join(b, pick=treegen.best("x", by="logprob"))

    s = greedy.run(smol)
    for st in s._run.states[1:]:
        start, n = st.info["x"]["start"], st.info["x"]["tokens"]
        ids = st.tree.path_tokens(st.node)[:start] + st.gen_tokens("x")  # (a final EOS is not in the context)
        with torch.no_grad():
            logp = hf_smol(torch.tensor([ids])).logits[0].log_softmax(-1)
        want = torch.stack([logp[start - 1 + i, ids[start + i]] for i in range(n)]).mean()
        assert st.info["x"]["logprob"] == pytest.approx(float(want), abs=1e-4)
    assert s["pick"] == s["x"][s.info["pick"]["winners"][0]]
    assert s.info["pick"]["winners"][0] == max(range(2), key=lambda i: s._run.states[1 + i].info["x"]["logprob"])


def test_concat_builds_a_new_prompt(smol):
    @treegen.program
    def summarise(s):
        s += FEW_SHOT
        b = s.fork(2, content=["Q: 1 + 1?\nA:", "Q: 2 + 1?\nA:"])
        b += treegen.gen("x", max_tokens=5, stop="\n")
        s.join(b, both=treegen.concat("x", sep="\n"))
        s += "Answers so far:\n" + s["both"] + "\nSummary:" + treegen.gen("summary", max_tokens=4)

    s = summarise.run(smol)
    assert "Answers so far:\n" + "\n".join(s["x"]) in s.text()
    assert isinstance(s["summary"], str)


def test_reduction_errors_name_what_is_wrong(smol):
    def body(reduction, name="r"):
        @treegen.program
        def p(s):
            s += "x"
            b = s.fork(2)
            b += treegen.gen("y", max_tokens=2)
            s.join(b, **{name: reduction})
        return p.compile(tokenizer=smol.tokenizer)

    with pytest.raises(ValueError, match="reads 'z', which the branches do not set \\(they set: y\\)"):
        body(treegen.vote("z"))
    with pytest.raises(ValueError, match="reads 'score'"):
        body(treegen.best("y", by="score"))
    with pytest.raises(ValueError, match="must be a new identifier"):
        body(treegen.vote("y"), name="y")
    with pytest.raises(TypeError, match="must be a reduction"):
        body("y")
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        treegen.top_k("y", by=len, k=0)
    with pytest.raises(ValueError, match="by must be a variable name"):
        treegen.best("y", by=3)
    with pytest.raises(ValueError, match="unknown reduction kind 'mean'; the kinds are collect, vote"):
        Reduce("mean", "y")


def test_a_reduction_that_fails_when_computed_names_itself(smol):
    @treegen.program
    def p(s):
        s += "x"
        b = s.fork(2)
        b += treegen.gen("y", max_tokens=2)
        s.join(b, r=treegen.best("y", by=lambda text: [text]))

    with pytest.raises(TypeError, match=r"reduction 'r' \(best of 'y'\): a score must be a number or text, got list"):
        p.run(smol)


def test_a_reduction_read_in_later_branches_stays_one_value(smol):
    """Branches forked after a join inherit its reduction; reading it there computes it once, for all,
    and does not make it a variable of theirs (the next join does not turn it into a list)."""
    @treegen.program
    def p(s):
        s += FEW_SHOT + "Q: 1 + 2?\nA:"
        b = s.fork(2)
        b += treegen.gen("x", max_tokens=6)
        s.join(b, a=treegen.vote("x", extract=r"(\d+)"))
        c = s.fork(2)
        for st in c:
            st += f" So {st['a']}."  # read in each branch, before the parent reads it
        c += treegen.gen("y", max_tokens=2)
        s.join(c)

    s = p.run(smol)
    assert s["a"] == reduce.vote(s["x"], r"(\d+)") and not isinstance(s["a"], list)
    assert s.info["a"]["reduction"] == "vote" and len(s["y"]) == 2
