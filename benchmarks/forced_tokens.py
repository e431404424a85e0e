"""How many of a constrained answer's tokens its constraint forces — steps where the mask allows exactly
one token, which jump-forward would append without a forward pass of their own — on the embedded
SmolLM2-135M-Instruct (its real BPE vocabulary; CPU).

Each constraint's answers are sampled at temperature 1 below a word problem; every answer's tokens are
then replayed through a fresh xgrammar matcher, counting at each step the tokens its mask allows.
``forced_share``: the share of an answer's token steps (its final EOS excluded) that allow one token;
``forced_runs``: how many forced tokens come in a row. At best jump-forward saves one decode step per
forced token: it is appended without being drawn and computed in the same forward as the token before
it (that step's row of the branch then has two or more queries), so ``steps_jump_forward_could_save``
is ``forced_steps``, as a share of the answers' token steps ``forced_share``.

    python benchmarks/forced_tokens.py [--samples 32] [--out benchmarks/results/forced_tokens_smollm2.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench_constrained import ANSWER_REGEX, ANSWER_SCHEMA, CHOICES  # benchmarks/
from treegen.runtime.constraint import Constraint
from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.sampler import SamplingParams

QUESTION = "Q: A farmer has 12 cows and buys 7 more. How many cows does he have?\nA:"


def allowed_counts(engine: Engine, constraint: Constraint, tokens: list[int]) -> list[int]:
    """Tokens the constraint allows before each of ``tokens`` (replayed through a fresh matcher)."""
    matcher = engine.grammars.matcher(constraint)
    bitmask = torch.full((1, engine.grammars.mask_width), -1, dtype=torch.int32)
    counts = []
    for t in tokens:
        matcher.fill_next_token_bitmask(bitmask)
        words = bitmask[0].numpy().view("uint32")
        counts.append(int(sum(bin(int(w)).count("1") for w in words if w)))
        if not matcher.accept_token(t):
            raise RuntimeError(f"token {t} was not allowed")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "forced_tokens_smollm2.json"))
    args = parser.parse_args()
    engine = Engine.load()
    tok = engine.tokenizer
    prompt = tok.encode(QUESTION, add_special_tokens=False)
    kinds = {"answer": Constraint.of(regex=ANSWER_REGEX), "json_answer": Constraint.of(json_schema=ANSWER_SCHEMA),
             "choice": Constraint.of(choices=CHOICES)}
    rows = []
    for name, constraint in kinds.items():
        run = engine.start()
        root = run.tree.add_node(None, prompt)
        leaves = [run.tree.add_node(root, ()) for _ in range(args.samples)]
        results, _ = run.execute([GenRequest(leaf, SamplingParams(max_tokens=64, temperature=1.0, constraint=constraint),
                                             key=i) for i, leaf in enumerate(leaves)], [])
        steps = forced = ends = 0
        runs: list[int] = []
        for r in results:
            body = [t for t in r.tokens if t not in engine.model.eos_token_ids]
            counts = allowed_counts(engine, constraint, body)
            steps += len(counts)
            forced += sum(c == 1 for c in counts)
            length = 0
            for c in counts + [0]:
                if c == 1:
                    length += 1
                elif length:
                    runs.append(length)
                    length = 0
            if r.finish_reason == "eos":
                ends += 1
        row = {"constraint": name, "spec": str(constraint), "samples": len(results), "token_steps": steps,
               "forced_steps": forced, "forced_share": forced / max(steps, 1),
               "forced_runs": {str(n): runs.count(n) for n in sorted(set(runs))},
               "steps_jump_forward_could_save": forced,
               "complete": sum(bool(r.constraint_met) for r in results), "ended_at_eos": ends,
               "examples": [r.text for r in results[:4]]}
        rows.append(row)
        print({k: v for k, v in row.items() if k != "examples"}, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "forced_tokens", "model": "SmolLM2-135M-Instruct (embedded)",
                               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
