"""Tree-of-thought search (breadth-first) with pruning that keeps prefix sharing.

At each level every state in the frontier proposes ``k`` thoughts (one ``gen`` each, all batched),
each thought is judged by a ``select`` in a throw-away branch (the score is the log-probability of
" yes" minus that of " no"), the best ``b`` thoughts of the whole level are kept and the others are
**pruned**: ``state.prune()`` frees their KV at once. Kept thoughts continue from the KV they already
have — the next level forks below them, nothing is computed again.

    python examples/tree_of_thought.py [--k 3] [--b 2] [--d 2] [--model PATH_OR_HUB_ID]

The puzzle is small arithmetic (reach a target with a few numbers); the embedded 135M model is no
good at it, the point is the shape of the search: ``d`` levels, ``k`` proposals per kept state,
``b`` kept per level, KV freed as branches are pruned.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import treegen
from treegen.lang import reduce

PUZZLE = "Use the numbers 4, 6 and 9 once each, with + - * /, to make 30."
INTRO = "Solve the puzzle step by step. Each step combines two numbers.\n"
JUDGE = "\nIs this step correct and useful? Answer yes or no:"


def step_prompt(depth: int, i: int) -> str:
    return f"\nStep {depth + 1}, idea {i + 1}:"


@treegen.program
def tree_of_thought(s, puzzle: str = PUZZLE, *, k: int = 3, b: int = 2, d: int = 2, max_tokens: int = 24,
                    temperature: float = 0.7, stop: str | None = "\n",
                    on_level: Callable | None = None):
    """Breadth-first tree of thought. Sets ``s["best"]`` (the best path's thoughts), ``s["scores"]``.

    ``on_level(depth, kept, pruned, freed_bytes)`` is called after each level's pruning (tests, demos).
    """
    s += INTRO + f"Puzzle: {puzzle}\n"
    frontier, thoughts = [s], {id(s): []}
    for depth in range(d):
        # propose: k thoughts below every kept state, all generated in one batch
        proposals = []
        for parent in frontier:
            group = parent.fork(k, content=lambda i: step_prompt(depth, i))
            group += treegen.gen("thought", max_tokens=max_tokens, temperature=temperature, stop=stop or ())
            for child in group:
                thoughts[id(child)] = thoughts[id(parent)] + [child]
            proposals += list(group)
        # judge: one throw-away branch per thought, all scored in one batched prefill
        judges = [p.fork(1, content=JUDGE)[0] for p in proposals]
        for j in judges:
            j += treegen.select("verdict", [" yes", " no"])
        scores = []
        for j in judges:
            j["verdict"]  # runs every queued judgement together
            sc = j.info["verdict"]["scores"]
            scores.append(sc[" yes"] - sc[" no"])
        freed = sum(j.prune() for j in judges)
        # keep the b best of the level (ties: the first in branch order), prune the others at once
        for p, sc in zip(proposals, scores):
            p["score"] = sc
        order = reduce.ranking(scores)
        kept = [proposals[i] for i in order[:b]]
        pruned = [proposals[i] for i in order[b:]]
        freed += sum(p.prune() for p in pruned)
        if on_level is not None:
            on_level(depth, kept, pruned, freed)
        frontier = kept
    best = frontier[0]
    s["best"] = [st["thought"] for st in thoughts[id(best)]]
    s["scores"] = [st["score"] for st in thoughts[id(best)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3, help="thoughts proposed per kept state")
    parser.add_argument("--b", type=int, default=2, help="thoughts kept per level")
    parser.add_argument("--d", type=int, default=2, help="levels")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    engine = treegen.Engine.load(args.model)

    def on_level(depth, kept, pruned, freed):
        kv = kept[0]._run.tree_run.kv
        print(f"level {depth + 1}: kept {len(kept)}, pruned {len(pruned)}, freed {freed / 2**20:.2f} MiB "
              f"of KV, {kv.bytes_held() / 2**20:.2f} MiB held")

    start = time.perf_counter()
    result = tree_of_thought.run(engine, k=args.k, b=args.b, d=args.d, max_tokens=args.max_tokens,
                                 seed=args.seed, on_level=on_level)
    for depth, (thought, score) in enumerate(zip(result["best"], result["scores"])):
        print(f"step {depth + 1} (score {score:+.2f}):{thought}")
    print(f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
