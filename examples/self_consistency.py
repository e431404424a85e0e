"""Self-consistency: a few-shot prompt, one problem, N sampled answers, a majority vote.

The few-shot prompt and the problem are prefilled once and their KV is stored once; the N samples
decode together, each reading the shared prefix through hierarchical tree attention.

    python examples/self_consistency.py [--n 8] [--model PATH_OR_HUB_ID] [--seed 0]
"""

import argparse
import re
import time
from collections import Counter

from rich.console import Console
from rich.table import Table

import treegen

FEW_SHOT = """Q: Tom has 3 apples and buys 2 more. How many apples does he have?
A: Tom starts with 3 apples. He buys 2 more, so 3 + 2 = 5. The answer is 5.

Q: A box holds 4 pens. How many pens are in 3 boxes?
A: Each box holds 4 pens, so 3 boxes hold 3 * 4 = 12. The answer is 12.

Q: Sara had 10 stickers and gave away 4. How many are left?
A: She had 10 and gave away 4, so 10 - 4 = 6. The answer is 6.

"""

QUESTION = "Ben has 6 marbles and wins 3 more. How many marbles does he have now?"


@treegen.program
def self_consistency(s, question, n=8):
    s += FEW_SHOT + f"Q: {question}\nA:"
    samples = s.fork(n)
    samples += treegen.gen("reasoning", max_tokens=48, stop="\n", temperature=0.7, top_p=0.95)
    s.join(samples)


def extract_answer(reasoning: str) -> str | None:
    """The number after 'The answer is', else the last number in the text."""
    found = re.search(r"answer is\s*(-?\d+)", reasoning) or re.search(r"(-?\d+)(?!.*\d)", reasoning)
    return found.group(1) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8, help="samples (default 8)")
    parser.add_argument("--model", default=None, help="HF checkpoint path or hub id (default: embedded SmolLM2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    console = Console()
    with console.status("loading model"):
        engine = treegen.Engine.load(args.model)
    compiled = self_consistency.compile(QUESTION, n=args.n, tokenizer=engine.tokenizer)
    stats = compiled.stats(engine.kv_shape)
    console.print(f"sharing tree: {stats.nodes} nodes, {stats.branches} branches, KV {stats.stored_bytes / 2**20:.1f} MiB "
                  f"stored vs {stats.unshared_bytes / 2**20:.1f} MiB unshared ({stats.saving:.0%} saved)")

    start = time.perf_counter()
    result = self_consistency.run(engine, QUESTION, n=args.n, seed=args.seed)
    elapsed = time.perf_counter() - start

    answers = [extract_answer(r) for r in result["reasoning"]]
    votes = Counter(a for a in answers if a is not None)
    table = Table(title=f"Q: {QUESTION}")
    table.add_column("#", justify="right")
    table.add_column("sampled reasoning")
    table.add_column("answer", justify="right")
    for i, (text, answer) in enumerate(zip(result["reasoning"], answers)):
        table.add_row(str(i), text.strip(), answer or "-")
    console.print(table)
    if votes:
        winner, count = votes.most_common(1)[0]
        console.print(f"majority vote: [bold]{winner}[/bold] ({count}/{args.n} samples)   votes: {dict(votes)}")
    else:
        console.print("majority vote: no sample produced a number")
    console.print(f"{args.n} samples in {elapsed:.1f} s on {engine.model.device}")


if __name__ == "__main__":
    main()
