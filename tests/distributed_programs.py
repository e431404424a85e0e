"""Programs and a worker for the distributed tests (tests/test_distributed.py), run by ``torchrun``:

    torchrun --nproc-per-node 2 tests/distributed_programs.py CHECKPOINT OUT.json --tp 2 [--dp 1] [--fail-rank R]
                                                                                   [--slice N]

Each rank loads its shard of CHECKPOINT (fp32, CPU, gloo), runs :func:`workload` and writes what it
generated to ``OUT.json.rank<R>``. ``--fail-rank R``: rank R raises in the middle of generating.
``--slice N``: gens reserve N tokens at a time (``Engine(slice_tokens=N)``, under a bounded KV budget
with offload to the host) and pause at each slice's end (the scheduler's ``extend``, which would give them
their next slice at once from the budget's spare room, turned off), so branches pause and resume on every
rank; the rank's pauses go in its output.
"""

import argparse
import json
import os
import sys
import time

import treegen


@treegen.program
def self_consistency(s, n):
    s += "Question: what is two plus two? Think step by step."
    b = s.fork(n)
    b += treegen.gen("answer", max_tokens=8, temperature=0.9, top_p=0.95)
    s.join(b)
    s += " Final:"
    s += treegen.gen("final", max_tokens=5)


@treegen.program
def problem(s, k, n):
    s += "Solve each problem carefully and show the work. " * 2
    s += f"Problem {k}: {k} times {k + 1} is"
    b = s.fork(n)
    b += treegen.gen("x", max_tokens=6, temperature=0.8)
    s.join(b)
    s += treegen.gen("greedy", max_tokens=4)


PROBLEMS = [{"k": k, "n": 2} for k in range(5)]


@treegen.program
def refuse(s, k):
    """Program 3 raises after its first gen; the others finish."""
    s += f"Problem {k}: say something."
    s += treegen.gen("x", max_tokens=4)
    if k == 3:
        _ = s["x"]
        raise ValueError(f"program {k} refuses")


@treegen.program
def die_in_replica(s, k, die):
    """Kills the data-parallel replica process that runs it (when ``die``), after its first gen: a
    replica that dies mid-batch. (Traced in the leader first, it stops at the read: nothing dies there.)"""
    s += f"Problem {k}: say something."
    s += treegen.gen("x", max_tokens=4)
    _ = s["x"]
    if die:
        import multiprocessing
        import signal

        if multiprocessing.current_process().name.startswith("treegen-dp-replica"):
            time.sleep(3)  # (the other replica's programs finish meanwhile: their results are kept)
            os.kill(os.getpid(), signal.SIGKILL)
    s += treegen.gen("y", max_tokens=4)


def _cannot_load():
    raise ImportError("this body cannot be rebuilt in another process")


class Unloadable:
    """A program body that pickles here but cannot be unpickled in a replica process."""

    def __call__(self, s) -> None:
        s += "Hello"

    def __reduce__(self):
        return _cannot_load, ()


def workload(engine, on_tokens=None) -> dict:
    """What the tests compare: a self-consistency run (sampled and greedy) and a two-level batch."""
    sc = self_consistency.run(engine, 3, seed=7, on_tokens=on_tokens)
    batch = problem.run_batch(engine, PROBLEMS, seed=3, on_tokens=on_tokens)
    return {"answer": sc["answer"], "final": sc["final"],
            "batch": [{"x": r["x"], "greedy": r["greedy"], "tokens": r.tokens()} for r in batch]}


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=None)
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--slice", type=int, default=None)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from treegen.runtime import decode, scheduler
    from treegen.runtime.engine import Engine

    options = {}
    pauses = []
    if args.slice is not None:
        scheduler.Scheduler.extend = lambda self, job, drawn: False
        options = dict(kv_budget_bytes=2**30, offload="host", slice_tokens=args.slice)
        phase = decode.Decoder.phase

        def counted(self, joining=()):  # (each run's pauses, read when its phases end)
            yield from phase(self, joining)
            pauses.append(self.pauses)

        decode.Decoder.phase = counted
    engine = Engine.load(args.checkpoint, tensor_parallel=args.tp, data_parallel=args.dp, **options)
    rank = engine.parallel.rank
    seen = [0]

    def fail_midway(stream) -> None:
        seen[0] += 1
        if seen[0] == 3:
            raise RuntimeError(f"injected failure on rank {rank}")

    hook = fail_midway if args.fail_rank == rank else None
    out = workload(engine, on_tokens=hook)
    if args.slice is not None:
        out["most_pauses"] = max(pauses, default=0)
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump(out, f)
    engine.close()  # every rank done before any ends the process group (as torch asks of a torchrun script)


if __name__ == "__main__":
    sys.exit(main())
