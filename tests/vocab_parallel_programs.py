"""What the vocabulary-split tests (tests/test_vocab_parallel.py) run, and their torchrun worker:

    torchrun --nproc-per-node 2 tests/vocab_parallel_programs.py random OUT
    torchrun --nproc-per-node 2 tests/vocab_parallel_programs.py CHECKPOINT OUT [--vocab-parallel on|off]

``random``: each rank builds random fp32 models (an odd vocabulary that 2 does not divide, untied; and
a tied one) whole, split over the two ranks with the LM head split by vocabulary, and split with the
head whole; the runtime workload must give the whole model's tokens (log-probabilities and scores
within 1e-5) both ways, and the same on both ranks. Writes ``OUT.rank<R>`` ("ok" and what it checked).
CHECKPOINT: loads it with ``tensor_parallel=2`` and writes the runtime workload's results (with a
constrained gen) to ``OUT.rank<R>``.
"""

import argparse
import dataclasses
import json
import os
import sys

import torch

from treegen.runtime.constraint import Constraint
from treegen.runtime.requests import GenRequest, ScoreRequest
from treegen.runtime.sampler import SamplingParams

PROMPT = list(range(40, 72))
# gens run in separate executes: a phase gathers the whole logits when any of its rows filters (top-p/k)
BATCHES = {
    "greedy": [SamplingParams(max_tokens=7, ignore_eos=True)] * 2,
    "temperature": [SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True),
                    SamplingParams(max_tokens=6, temperature=1.3, ignore_eos=True),
                    SamplingParams(max_tokens=5, ignore_eos=True)],  # (a greedy row among sampled ones)
    "filtered": [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, ignore_eos=True),
                 SamplingParams(max_tokens=6, temperature=1.0, top_k=5, ignore_eos=True),
                 SamplingParams(max_tokens=4, temperature=0.7, ignore_eos=True)],
}
CONSTRAINED = {
    "constrained": [SamplingParams(max_tokens=10, temperature=1.0, constraint=Constraint.of(regex="[0-9]{1,4} (cows|dollars)")),
                    SamplingParams(max_tokens=6, temperature=0.9)],
    "constrained_filtered": [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.8,
                                            constraint=Constraint.of(choices=["nineteen", "19", "17 cows"]))],
}


def runtime_workload(engine, prompt=PROMPT, constrained: bool = False) -> dict:
    """Tokens, log-probabilities, ``select`` scores and prefill logits of a few runs on one shared prompt."""
    out = {}
    batches = dict(BATCHES, **(CONSTRAINED if constrained else {}))
    for name, params in batches.items():
        run = engine.start()
        root = run.tree.add_node(None, list(prompt))
        leaves = [run.tree.add_node(root, [prompt[i] + 1]) for i in range(len(params))]
        choices = tuple(run.tree.add_node(root, [prompt[0] + k, prompt[1] + 2 * k]) for k in range(3))
        gens = [GenRequest(leaf, p, key=17 * i + len(name), final=True) for i, (leaf, p) in enumerate(zip(leaves, params))]
        # (submit and advance, not run.execute: a LeaderRun's execute calls its own mirrored advance, refused)
        jobs = [run.submit(r) for r in [*gens, ScoreRequest(root, choices)]]
        while not all(j.done for j in jobs) and run.advance():
            pass
        results = [j.result for j in jobs[:-1]]
        assert run.decode_phases and run.mixed_steps, f"{name}: the sampler ran in decode phases and mixed steps"
        out[name] = {"tokens": [list(r.tokens) for r in results], "logprobs": [list(r.logprobs) for r in results],
                     "scores": jobs[-1].result}
    run = engine.start()
    root = run.tree.add_node(None, list(prompt))
    leaf = run.tree.add_node(root, [prompt[3], prompt[5]])
    logits = run.prefill([root, leaf])
    out["prefill"] = torch.cat([logits[root][-2:], logits[leaf]]).tolist()
    return out


def assert_close(got: dict, want: dict, what: str) -> None:
    """Tokens identical; log-probabilities, scores and prefill logits within 1e-5."""
    assert got.keys() == want.keys(), (what, got.keys(), want.keys())
    for name in want:
        if name == "prefill":
            torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(want[name]), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{what}: prefill logits: {m}")
            continue
        assert got[name]["tokens"] == want[name]["tokens"], (what, name, got[name]["tokens"], want[name]["tokens"])
        for key in ("logprobs", "scores"):
            g = torch.tensor([x for row in got[name][key] for x in (row if isinstance(row, list) else [row])])
            w = torch.tensor([x for row in want[name][key] for x in (row if isinstance(row, list) else [row])])
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {name} {key}: {m}")


def random_models(out: str) -> None:
    from transformers import LlamaConfig

    from treegen.runtime.distributed import init_parallel
    from treegen.runtime.engine import Engine
    from treegen.runtime.loader import IdTokenizer
    from treegen.runtime.model import LlamaFamilyModel

    tp2 = init_parallel(tensor_parallel=2, device="cpu")
    checked = []
    for vocab, tied in ((1001, False), (999, True)):
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          tie_word_embeddings=tied)
        whole = LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cpu", std=0.2)
        want = runtime_workload(Engine(whole, IdTokenizer()))
        for split in (True, False):
            tp = dataclasses.replace(tp2.tensor, vocab_parallel=split)
            model = LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cpu", std=0.2, tp=tp)
            if split:
                per = 512  # ceil(vocab / 2) rounded up to a multiple of 32: rank 1 holds the rest (489 / 487)
                start, stop = (0, per) if tp2.tp_rank == 0 else (per, vocab)
                s = model.vocab_split
                assert (s.start, s.stop, model.vocab_size) == (start, stop, vocab), s
                assert model.lm_head.shape == (stop - start, 64), model.lm_head.shape
                if tied:  # a view of the whole embedding's rows, no copy
                    assert model.lm_head.data_ptr() == model.embed[start].data_ptr()
            else:
                assert model.vocab_split is None and model.lm_head.shape == (vocab, 64)
            got = runtime_workload(Engine(model, IdTokenizer(), parallel=tp2))
            what = f"vocab {vocab}{' tied' if tied else ''}, head {'split' if split else 'whole'}"
            assert_close(got, want, what)
            both = [None, None]
            torch.distributed.all_gather_object(both, got)
            assert both[0] == both[1], f"{what}: the ranks differ"
            checked.append(what)
    with open(f"{out}.rank{tp2.rank}", "w") as f:
        json.dump({"ok": True, "checked": checked}, f)
    torch.distributed.destroy_process_group()


def checkpoint_run(checkpoint: str, out: str, vocab_parallel) -> None:
    from treegen.runtime.engine import Engine

    engine = Engine.load(checkpoint, tensor_parallel=2, vocab_parallel=vocab_parallel)
    split = engine.model.vocab_split
    got = runtime_workload(engine, constrained=True)
    got["_vocab_split"] = None if split is None else [split.start, split.stop, int(engine.model.lm_head.shape[0])]
    with open(f"{out}.rank{engine.parallel.rank}", "w") as f:
        json.dump(got, f)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = argparse.ArgumentParser()
    p.add_argument("source", help="'random' or a checkpoint folder")
    p.add_argument("out")
    p.add_argument("--vocab-parallel", choices=["on", "off", "auto"], default="on")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.source == "random":
        random_models(args.out)
    else:
        checkpoint_run(args.source, args.out, {"on": True, "off": False, "auto": "auto"}[args.vocab_parallel])


if __name__ == "__main__":
    sys.exit(main())
