"""End to end on the embedded SmolLM2 and on a tiny random GQA Llama, against Hugging Face."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import treegen
from treegen.runtime.engine import Engine

FEW_SHOT = "Q: Tom has 3 apples and buys 2 more. How many apples does he have?\nA: 3 + 2 = 5. The answer is 5.\n\n"


def gen_records(root):
    """(prompt ids, generated ids, params, finish_reason) for every gen of every state of a run."""
    out = []
    for st in root._run.states:
        for name, info in st.info.items():
            if "finish_reason" in info:
                prompt = st.tree.path_tokens(st.node)[:info["start"]]
                out.append((prompt, st.gen_tokens(name), info, st))  # (the gen's tokens, a final EOS included)
    return out


def check_against_hf(hf, tokenizer, records, eos):
    for prompt, generated, info, st in records:
        max_new = info["max_tokens"]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                              eos_token_id=sorted(eos), pad_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist()
        assert generated == ref[: len(generated)], f"branch {st.path}: {generated} vs HF {ref}"
        if info["finish_reason"] == "length":
            assert len(generated) == max_new
        elif info["finish_reason"] == "eos":
            assert generated[-1] in eos and ref == generated
        else:  # stop string: the first prefix of HF's tokens whose text contains it
            assert info["finish_reason"] == "stop"
            assert all(s not in tokenizer.decode(generated[:-1]) for s in info["stop"])


def test_greedy_nested_forks_match_hf_generate(smol, hf_smol):
    @treegen.program
    def prog(s):
        s += FEW_SHOT
        problems = s.fork(3, content=[f"Q: Ann has {k} pens and gets {k + 1} more. How many pens?\nA:" for k in (2, 4, 7)])
        problems += [treegen.gen("a", max_tokens=5), treegen.gen("a", max_tokens=9), treegen.gen("a", max_tokens=30, stop=".")]
        checks = problems.fork(2, content=lambda i: [" Check:", " So"][i])
        checks += lambda i: treegen.gen("b", max_tokens=4 + 3 * i, stop="\n")
        problems.join(checks)
        s.join(problems)

    root = prog.run(smol)
    records = gen_records(root)
    assert len(records) == 3 + 6
    assert len({len(g) for _, g, _, _ in records}) > 2  # branches stop at different lengths
    check_against_hf(hf_smol, smol.tokenizer, records, smol.model.eos_token_ids)
    assert len(root["a"]) == 3 and len(root["b"]) == 3 and all(len(x) == 2 for x in root["b"])


def test_greedy_until_eos_matches_hf(smol, hf_smol):
    @treegen.program
    def prog(s):
        s += treegen.user("Say hello in one word.")
        s += treegen.assistant(treegen.gen("reply", max_tokens=40))

    root = prog.run(smol)
    records = gen_records(root)
    assert records[0][2]["finish_reason"] == "eos"
    assert root.text().endswith("<|im_end|>\n") and not root.text().endswith("<|im_end|><|im_end|>\n")
    check_against_hf(hf_smol, smol.tokenizer, records, smol.model.eos_token_ids)


def test_a_message_ended_by_eos_or_by_its_end_of_turn_as_a_stop_string_has_one_end_of_turn(smol):
    """An assistant message whose gen ends on EOS (left out of the context) or on a stop string that is the
    end-of-turn's text (as vLLM and SGLang users write ``stop=["<|im_end|>"]``; the token stays on the node)
    gets one end-of-turn from the message's end, not two: the same tokens either way."""
    ids = []
    for stop in (None, ["<|im_end|>"]):
        @treegen.program
        def prog(s):
            s += treegen.user("Say hello in one word.")
            s += treegen.assistant(treegen.gen("reply", max_tokens=40, **({"stop": stop} if stop else {})))
            s += treegen.user("Again.")

        root = prog.run(smol)
        assert root.info["reply"]["finish_reason"] == ("eos" if stop is None else "stop")
        assert "<|im_end|><|im_end|>" not in root.text() and root.text().endswith("Again.<|im_end|>\n")
        ids.append(root.tokens())
    assert ids[0] == ids[1]


def test_chat_roles_follow_the_template(smol):
    @treegen.program
    def prog(s):
        s += treegen.system("You are terse.") + treegen.user("Hi")
        s += treegen.assistant("Hello") + treegen.user("Bye")

    root = prog.run(smol)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert root.text() == smol.tokenizer.apply_chat_template(messages, tokenize=False)


def test_select_scores_by_normalised_logprob_in_one_prefill(smol, hf_smol):
    choices = [" 5", " seven", " twelve apples"]

    @treegen.program
    def prog(s):
        s += FEW_SHOT + "Q: Ann has 2 pens and gets 3 more. How many pens?\nA: The answer is"
        s += treegen.select("answer", choices)

    root = prog.run(smol)
    assert root._run.tree_run.forward_passes == 1
    tok = smol.tokenizer
    prompt = root.tree.path_tokens(root.tree.parent(root.node))
    want = {}
    for c in choices:
        ids = tok(c, add_special_tokens=False).input_ids
        with torch.no_grad():
            logp = hf_smol(torch.tensor([prompt + ids])).logits[0].log_softmax(-1)
        want[c] = float(torch.stack([logp[len(prompt) - 1 + i, t] for i, t in enumerate(ids)]).mean())
    got = root.info["answer"]["scores"]
    for c in choices:
        assert got[c] == pytest.approx(want[c], abs=1e-4)
    assert root["answer"] == max(choices, key=want.get)
    assert root.text().endswith(root["answer"])


def test_sampling_is_seeded_and_branches_differ(smol):
    @treegen.program
    def prog(s):
        s += "Once upon a time"
        b = s.fork(4)
        b += treegen.gen("story", max_tokens=8, temperature=1.0, top_p=0.95, top_k=50)
        s.join(b)

    first = prog.run(smol, seed=3)["story"]
    assert prog.run(smol, seed=3)["story"] == first
    assert len(set(first)) > 1
    assert prog.run(smol, seed=4)["story"] != first


def test_shared_prefix_kv_is_stored_once(smol):
    seen = {}

    @treegen.program
    def prog(s):
        s += FEW_SHOT * 2
        b = s.fork(8)
        b += treegen.gen("x", max_tokens=6)
        for branch in b:
            branch["x"]  # run now, to look at the KV held while the branches are open
        kv = s._run.tree_run.kv
        seen["held"] = kv.bytes_held()
        seen["per_token"] = kv.bytes_per_token
        seen["prompt"] = len(s.tree.tokens(s.node))
        seen["generated"] = [c["tokens"] for c in (st.info["x"] for st in s._run.states[1:])]
        s.join(b)  # joined branches read no more KV: theirs is freed, the shared prompt stays
        seen["after join"] = kv.bytes_held()

    prog.run(smol)
    # the prompt once, plus each branch's tokens but its last (sampled, not yet run through the model)
    stored = seen["prompt"] + sum(n - 1 for n in seen["generated"])
    assert seen["held"] == stored * seen["per_token"]
    unshared = sum(seen["prompt"] + n - 1 for n in seen["generated"])
    assert seen["held"] < unshared * seen["per_token"] / 4
    assert seen["after join"] == seen["prompt"] * seen["per_token"]


def test_compiled_tree_is_known_before_running(smol):
    @treegen.program
    def prog(s, n):
        s += FEW_SHOT
        b = s.fork(n)
        b += treegen.gen("x", max_tokens=16)
        s.join(b)

    compiled = prog.compile(3, tokenizer=smol.tokenizer)
    assert compiled.complete
    tree = compiled.tree
    assert [tree.branches_below(n) for n in tree.live_nodes()] == [3, 1, 1, 1]
    stats = compiled.stats(smol.kv_shape)
    prompt = len(smol.tokenizer(FEW_SHOT, add_special_tokens=False).input_ids)
    assert stats.stored_tokens == prompt + 3 * 16 and stats.unshared_tokens == 3 * (prompt + 16)
    assert stats.stored_bytes == stats.stored_tokens * smol.kv_shape.bytes_per_token
    ran = prog.run(smol, 3)
    assert ran.tree.tokens(0) == tree.tokens(0)

    @treegen.program
    def dynamic(s):
        s += "Pick a number:" + treegen.gen("k", max_tokens=2)
        s.fork(2 if "1" in s["k"] else 3)

    partial = dynamic.compile(tokenizer=smol.tokenizer)
    assert not partial.complete and partial.tree.graph.number_of_nodes() == 1


def test_random_gqa_logits_match_hf_with_forced_tokens(tiny_llama):
    """Prefill a tree, then force tokens into every leaf step by step (decode path): logits match HF."""
    hf, model = tiny_llama
    engine = Engine(model, None)
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, 49152, (n,), generator=g).tolist()  # noqa: E731
    run = engine.start()
    tree = run.tree
    root = tree.add_node(None, rand(23))
    mids = [tree.add_node(root, rand(k)) for k in (1, 17, 5)]
    leaves = [tree.add_node(mids[0], rand(3)), tree.add_node(mids[0], rand(9)), tree.add_node(mids[1], []),
              tree.add_node(mids[2], rand(37))]
    first = run.prefill(leaves)
    got = {n: [first[n]] for n in leaves}
    for step in range(4):  # decode: one forced token per leaf per step, leaves of different depths
        for n in leaves:
            tree.extend(n, rand(1))
        out = run.prefill(leaves)
        for n in leaves:
            got[n].append(out[n])
    for n in leaves:
        ids = tree.path_tokens(n)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].float()
        ours = torch.cat(got[n])
        torch.testing.assert_close(ours, want[len(ids) - len(ours):], atol=1e-4, rtol=1e-4)


def test_a_gen_ended_by_eos_leaves_it_out_of_the_context(smol, hf_smol):
    """The EOS that ends a gen is the gen's last token (its output, as HF's generate returns it) but not
    part of the branch's context: text after it follows the gen's text (as SGLang appends a gen's text),
    not an end-of-text mark mid-document — and a gen after that text matches HF on that context."""
    @treegen.program
    def prog(s):
        s += treegen.user("Say hello in one word.") + "<|im_start|>assistant\n"  # (no message end: text follows)
        s += treegen.gen("reply", max_tokens=40)
        s += "\nMore:"
        s += treegen.gen("more", max_tokens=4)

    root = prog.run(smol)
    eos = smol.model.eos_token_ids
    info = root.info["reply"]
    assert info["finish_reason"] == "eos" and info["eos"] in eos
    reply = root.gen_tokens("reply")
    assert len(reply) == info["tokens"] and reply[-1] == info["eos"]  # the gen's own output keeps its EOS
    ids = root.tokens()
    end = info["start"] + info["tokens"] - 1  # where the context's copy of the reply ends
    assert ids[info["start"]:end] == reply[:-1]
    assert ids[end:end + len(smol.tokenizer.encode("\nMore:"))] == smol.tokenizer.encode("\nMore:")
    assert not set(ids[info["start"]:]) & set(eos)  # no EOS after the prompt's messages
    assert root.info["more"]["start"] == len(ids) - root.info["more"]["tokens"] + ("eos" in root.info["more"])
    check_against_hf(hf_smol, smol.tokenizer, gen_records(root), eos)
