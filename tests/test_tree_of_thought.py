"""Tree-of-thought search with pruning (examples/tree_of_thought.py) against Hugging Face, branch by branch."""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import networkx as nx
import pytest
import torch

import treegen

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from tree_of_thought import INTRO, JUDGE, PUZZLE, step_prompt, tree_of_thought  # noqa: E402


def hf_tree_of_thought(hf, tok, eos, *, k, b, d, max_tokens):
    """The same breadth-first search, every branch run on its own with HF generate and HF logits."""
    ids = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    frontier, levels = [ids(INTRO + f"Puzzle: {PUZZLE}\n")], []
    with torch.no_grad():
        for depth in range(d):
            proposals = []
            for toks in frontier:
                for i in range(k):
                    prompt = toks + ids(step_prompt(depth, i))
                    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                      eos_token_id=sorted(eos), pad_token_id=tok.eos_token_id)[0, len(prompt):]
                    proposals.append(prompt + out.tolist())
            scores = []
            for toks in proposals:
                judge = toks + ids(JUDGE)
                lp = {}
                for choice in (" yes", " no"):
                    c = ids(choice)
                    logprobs = hf(torch.tensor([judge + c])).logits[0].float().log_softmax(-1)
                    lp[choice] = sum(float(logprobs[len(judge) - 1 + j, t]) for j, t in enumerate(c)) / len(c)
                scores.append(lp[" yes"] - lp[" no"])
            order = sorted(range(len(scores)), key=lambda i: -scores[i])
            frontier = [proposals[i] for i in order[:b]]
            levels.append({"proposals": proposals, "scores": scores, "kept": frontier})
    return levels


def test_greedy_tree_of_thought_matches_hf_and_frees_pruned_kv(smol, hf_smol):
    seen = []

    def on_level(depth, kept, pruned, freed):
        run = kept[0]._run
        kv, tree = run.tree_run.kv, run.tree
        gone = set()
        for p in pruned:
            gone |= {p.origin} | nx.descendants(tree.graph, p.origin)
        # every node of a pruned branch has given its KV back, and is marked pruned
        assert gone and not gone & set(kv.segments)
        assert all(tree.graph.nodes[n]["pruned"] for n in gone)
        assert freed > 0
        # the kept thoughts hold all their KV (the judge's prefill computed the last sampled token)
        for st in kept:
            assert kv.computed(st.node) == len(tree.tokens(st.node))
        seen.append({"kept": [st.tokens() for st in kept], "kept_nodes": [st.node for st in kept],
                     "segments": {st.node: kv.segments[st.node].start for st in kept},
                     "held": kv.bytes_held(), "scores": sorted(float(p["score"]) for p in kept + pruned)})
        if depth == 1:  # level 1's kept thought was extended in place, not prefilled again
            (node,) = seen[0]["kept_nodes"]
            assert kv.segments[node].start == seen[0]["segments"][node]
            assert kv.computed(node) == len(tree.tokens(node))

    root = tree_of_thought.run(smol, k=2, b=1, d=2, max_tokens=8, temperature=0.0, stop=None, on_level=on_level)
    ref = hf_tree_of_thought(hf_smol, smol.tokenizer, smol.model.eos_token_ids, k=2, b=1, d=2, max_tokens=8)
    assert len(seen) == 2
    for mine, theirs in zip(seen, ref):
        assert mine["kept"] == theirs["kept"]
        torch.testing.assert_close(mine["scores"], sorted(theirs["scores"]), rtol=1e-4, atol=1e-4)
    assert len(root["best"]) == 2 and len(root["scores"]) == 2
    assert root._run.finished and root._run.tree_run.kv.bytes_held() == 0


def test_prune_frees_exactly_the_branch_kv(smol):
    @treegen.program
    def prog(s):
        s += "Count: one, two,"
        b = s.fork(3, content=lambda i: [" three", " four, five", " six"][i])
        b += treegen.gen("x", max_tokens=3)
        return b

    seen = {}

    @treegen.program
    def outer(s):
        b = prog.fn(s)
        values = [st["x"] for st in b]  # run it; the branches stay open (not joined)
        kv, tree = s._run.tree_run.kv, s.tree
        branch = b[1]
        before = kv.bytes_held()
        own = tree.path(branch.node)[tree.path(branch.node).index(branch.origin):]
        expect = sum(kv.computed(n) for n in own) * kv.bytes_per_token
        freed = branch.prune()
        seen.update(before=before, after=kv.bytes_held(), freed=freed, expect=expect,
                    still=[kv.computed(st.node) for st in b])
        assert branch.prune() == 0  # twice is a no-op
        with pytest.raises(RuntimeError, match="pruned"):
            branch += "more"
        assert branch["x"] == values[1]  # values stay readable
        s.join(b)  # a pruned branch joins like the others
        assert s["x"] == values

    outer.run(smol)
    assert seen["freed"] == seen["expect"] > 0
    assert seen["after"] == seen["before"] - seen["freed"]
    assert seen["still"][1] == 0 and seen["still"][0] > 0 and seen["still"][2] > 0
