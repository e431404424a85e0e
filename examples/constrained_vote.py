"""Self-consistency with a constrained answer format: more samples the vote can count.

Each arithmetic word problem gets N sampled solutions and a majority vote over the number after
"The answer is". Sampled freely (one line, stop at the newline), some solutions ramble, stop early
or state the answer some other way, and are lost to the vote. With ``regex=`` every solution is one
line of reasoning that ends "The answer is <integer>." — where the text is complete, so the model
can only end it there; only a solution that ``max_tokens`` cuts short has no answer
(``constraint_met`` False; the vote skips it). Prints the
share of countable answers and the vote's accuracy, both ways, on the embedded SmolLM2 (CPU).

    python examples/constrained_vote.py [--n 8] [--temperature 0.8] [--model PATH_OR_HUB_ID]
"""

import argparse
import time

import treegen

FEW_SHOT = """Q: Tom has 3 apples and buys 2 more. How many apples does he have?
A: Tom starts with 3 apples and buys 2 more, so 3 + 2 = 5. The answer is 5.

Q: A box holds 4 pens. How many pens are in 3 boxes?
A: Each box holds 4 pens, so 3 boxes hold 3 * 4 = 12. The answer is 12.

Q: Sara had 10 stickers and gave away 4. How many are left?
A: She had 10 and gave away 4, so 10 - 4 = 6. The answer is 6.

"""

PROBLEMS = [
    ("Ben has 6 marbles and wins 3 more. How many marbles does he have now?", 9),
    ("A bag has 5 red balls and 7 blue balls. How many balls are in the bag?", 12),
    ("Lily reads 4 pages a day. How many pages does she read in 5 days?", 20),
    ("There were 15 birds on a tree and 6 flew away. How many birds are left?", 9),
    ("A pack has 8 crayons. How many crayons are in 2 packs?", 16),
    ("Max had 20 coins and spent 8. How many coins does he have left?", 12),
    ("A farmer has 12 cows and buys 7 more. How many cows does he have?", 19),
    ("Each car has 4 wheels. How many wheels do 3 cars have?", 12),
]

ANSWER = r"The answer is (-?\d+)"
# one line: reasoning without a full stop, at most one sentence break, then the answer, then nothing
# (no '.' may follow, so the text is complete there and the only token allowed next is EOS)
FORMAT = r"[^\n.]*(\. )?The answer is (0|-?[1-9][0-9]*)\."


def solve(constrained: bool, n: int, temperature: float, max_tokens: int):
    @treegen.program
    def program(s, question):
        s += FEW_SHOT + f"Q: {question}\nA:"
        samples = s.fork(n)
        if constrained:
            samples += treegen.gen("solution", max_tokens=max_tokens, temperature=temperature, regex=FORMAT)
        else:
            samples += treegen.gen("solution", max_tokens=max_tokens, temperature=temperature, stop="\n")
        s.join(samples, answer=treegen.vote("solution", extract=ANSWER))

    return program


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8, help="samples per problem (default 8)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--model", default=None, help="HF checkpoint path or hub id (default: embedded SmolLM2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    engine = treegen.Engine.load(args.model)
    inputs = [{"question": q} for q, _ in PROBLEMS]
    print(f"{len(PROBLEMS)} problems x {args.n} samples, temperature {args.temperature}, max_tokens {args.max_tokens}\n")
    print("| answer format | countable answers | vote correct | time |")
    print("|---|---|---|---|")
    for constrained in (False, True):
        started = time.perf_counter()
        roots = solve(constrained, args.n, args.temperature, args.max_tokens).run_batch(engine, inputs, seed=args.seed)
        elapsed = time.perf_counter() - started
        solutions = [text for r in roots for text in r["solution"]]
        countable = sum(sum(r.info["answer"]["votes"].values()) for r in roots)  # the answers the votes counted
        correct = sum(r["answer"] == str(want) for r, (_, want) in zip(roots, PROBLEMS))
        name = f"regex={FORMAT!r}" if constrained else "free (stop at newline)"
        print(f"| {name} | {countable}/{len(solutions)} ({countable / len(solutions):.0%}) | "
              f"{correct}/{len(PROBLEMS)} | {elapsed:.0f} s |", flush=True)
        if constrained:  # the constrained solutions that max_tokens cut short, if any, are incomplete
            infos = [st.info["solution"] for st in roots[0]._run.states  # (one run holds every program's states)
                     if "finish_reason" in st.info.get("solution", {})]
            short = sum(info["constraint_met"] is False for info in infos)
            print(f"\n(constrained: {short} solution(s) cut short by max_tokens, none of them counted)")
    example = roots[0]["solution"][0]
    print(f"\na constrained solution: {example!r}")


if __name__ == "__main__":
    main()
