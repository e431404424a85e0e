"""Problems that arrive while the batch runs, and follow-ups the answers ask for.

Each problem is solved by self-consistency (N samples, a vote). Problems come from a queue — here filled
up front, in a service by whatever produces them — and ``run_batch`` draws it as the run goes: a
program starts when its problem arrives and the engine has room, and its prompt is attached below the
few-shot prefix that earlier programs already computed (radix reuse: the prefix is prefilled once).
When a vote is not clear (the winning answer has less than ``--agree`` of the samples), ``on_result``
puts the problem back on the queue with twice the samples: a follow-up that joins the same run while
the other programs keep decoding. The run ends when the queue says so (``None``) and every program is done.

    python examples/follow_ups.py [--n 4] [--agree 0.75] [--model PATH_OR_HUB_ID]
"""

import argparse
import queue
import time

from rich.console import Console
from rich.table import Table

import treegen
from self_consistency import FEW_SHOT, extract_answer
from two_level import PROBLEMS

MORE_PROBLEMS = PROBLEMS + [
    "A farmer has 12 eggs and sells 5. How many eggs does he have left?",
    "Each pack has 6 cards. How many cards are in 2 packs?",
]


@treegen.program
def solve(s, question, n=4, max_tokens=40):
    s += FEW_SHOT + f"Q: {question}\nA:"
    samples = s.fork(n)
    samples += treegen.gen("reasoning", max_tokens=max_tokens, stop="\n", temperature=0.7, top_p=0.95)
    s.join(samples, answer=treegen.vote("reasoning", extract=extract_answer))
    answer = s["answer"]
    return {"answer": answer, "agreement": s.info["answer"]["votes"].get(answer, 0) / n}


def solve_all(engine, problems, *, n=4, agree=0.75, max_tokens=40, seed=0):
    """Every problem, asked again with twice the samples (once) when its vote is not clear; returns
    ``(inputs, roots)`` in the order the programs started (program ``i`` drew with seed ``seed + i``), and
    the run's attached prompt tokens."""
    todo: queue.Queue = queue.Queue()
    for question in problems:
        todo.put({"question": question, "n": n, "max_tokens": max_tokens})
    inputs, open_programs = [], [len(problems)]

    def arrived():  # the queue as an iterator: each input is recorded as it is drawn; None ends it
        for item in iter(todo.get, None):
            inputs.append(item)
            yield item

    def on_result(i, root):
        asked = inputs[i]
        if root.error is None and root.ret_value["agreement"] < agree and asked["n"] == n:
            todo.put(dict(asked, n=2 * n))  # a follow-up: the same question, more samples
            open_programs[0] += 1
        open_programs[0] -= 1
        if open_programs[0] == 0:
            todo.put(None)

    # one seed per program (a function of its index: these inputs arrive as the run goes), so that a
    # follow-up draws new samples rather than the first ones again
    roots = solve.run_batch(engine, arrived(), seeds=lambda i: seed + i, on_result=on_result)
    return inputs, roots, roots[0]._run.pass_report.get("attached_tokens", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4, help="samples per problem (default 4)")
    parser.add_argument("--agree", type=float, default=0.75, help="share of samples a clear vote needs")
    parser.add_argument("--model", default=None, help="HF checkpoint path or hub id (default: embedded SmolLM2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console()
    with console.status("loading model"):
        engine = treegen.Engine.load(args.model)
    start = time.perf_counter()
    inputs, roots, attached = solve_all(engine, MORE_PROBLEMS, n=args.n, agree=args.agree, seed=args.seed)
    elapsed = time.perf_counter() - start
    table = Table("problem", "samples", "answer", "agreement")
    for asked, root in zip(inputs, roots):
        table.add_row(asked["question"], str(asked["n"]), str(root.ret_value["answer"]),
                      f"{root.ret_value['agreement']:.0%}")
    console.print(table)
    console.print(f"{len(roots)} programs ({len(roots) - len(MORE_PROBLEMS)} follow-ups) in {elapsed:.1f} s; "
                  f"{attached} prompt tokens found already in the tree (the few-shot prefix, not prefilled again)")


if __name__ == "__main__":
    main()
