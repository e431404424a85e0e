"""Two-level sharing: one few-shot prefix shared by several problems, N samples for each problem.

The sharing tree has three levels: the few-shot prefix (stored once), one node per problem (stored
once per problem), and one leaf per sample. Decoding reads the prefix once for all P x N samples and
each problem once for its N samples.

    python examples/two_level.py [--n 4] [--model PATH_OR_HUB_ID]
"""

import argparse
import time

from rich.console import Console
from rich.table import Table

import treegen
from self_consistency import FEW_SHOT, extract_answer

PROBLEMS = [
    "Ben has 6 marbles and wins 3 more. How many marbles does he have now?",
    "A bag has 9 sweets. Mia eats 4. How many sweets are left?",
    "There are 5 cars with 4 wheels each. How many wheels are there?",
]


@treegen.program
def two_level(s, problems, n=4):
    s += FEW_SHOT
    per_problem = s.fork(len(problems), content=[f"Q: {q}\nA:" for q in problems])
    samples = per_problem.fork(n)
    samples += treegen.gen("reasoning", max_tokens=40, stop="\n", temperature=0.7)
    per_problem.join(samples)
    s.join(per_problem)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console()
    engine = treegen.Engine.load(args.model)
    stats = two_level.compile(PROBLEMS, n=args.n, tokenizer=engine.tokenizer).stats(engine.kv_shape)
    console.print(f"{stats.nodes} nodes, {stats.branches} branches; KV stored once per node: "
                  f"{stats.stored_bytes / 2**20:.1f} MiB vs {stats.unshared_bytes / 2**20:.1f} MiB unshared")
    start = time.perf_counter()
    result = two_level.run(engine, PROBLEMS, n=args.n, seed=args.seed)
    elapsed = time.perf_counter() - start
    table = Table("problem", "answers of the samples", "majority")
    for question, samples in zip(PROBLEMS, result["reasoning"]):
        answers = [extract_answer(r) or "-" for r in samples]
        majority = max(set(answers), key=lambda a: (answers.count(a), -answers.index(a)))
        table.add_row(question, ", ".join(answers), majority)
    console.print(table)
    console.print(f"{len(PROBLEMS)} problems x {args.n} samples in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
