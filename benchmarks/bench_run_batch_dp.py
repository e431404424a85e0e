"""A ``run_batch`` of many problems x N samples on N data-parallel replicas against one GPU.

The two-level APPS shape (the Hydragen paper's): one few-shot prefix, ``--problems`` problems below it,
``--samples`` greedy samples of ``--new`` tokens each (EOS ignored) per problem, as ``run_batch`` inputs.
Under torchrun with N processes: rank 0 runs the whole batch alone (one GPU), then every rank runs it
as one data-parallel batch (``run_batch`` splits the programs by whole prefix subtrees, balanced by
expected tokens; the results come back in input order). Reported: wall time of each, the speedup, and
each replica's own finish time (when its last program was done; the slowest over the mean is the
imbalance). Random bf16 weights of the named shape; a warm-up batch of the same sizes (other tokens)
before each timed one.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 benchmarks/bench_run_batch_dp.py --problems 64 --samples 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import time
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"

import torch
import torch.distributed as dist

import treegen
from treegen.runtime.distributed import init_parallel
from treegen.runtime.engine import Engine
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from bench_end_to_end import SHAPES, config_of  # benchmarks/


def text(ids) -> str:
    return " " + " ".join(map(str, ids))


@treegen.program
def apps(s, prefix, problem, samples, new):
    s += text(prefix) + text(problem)
    b = s.fork(samples)
    b += treegen.gen("code", max_tokens=new, ignore_eos=True)
    s.join(b)


def inputs(args, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    prefix = ids(args.prefix)
    return [dict(prefix=prefix, problem=ids(args.problem), samples=args.samples, new=args.new)
            for _ in range(args.problems)]


def timed_batch(engine, batch: list[dict]) -> tuple[float, float]:
    """(wall seconds of the whole batch, seconds until this process's own programs were all done)."""
    done_at = [None]
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if done == total and total > 0:  # (a replica given no programs: its finish is the batch's end)
            torch.cuda.synchronize()
            done_at[0] = time.perf_counter() - start

    apps.run_batch(engine, batch, on_programs=progress)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return wall, done_at[0] if done_at[0] is not None else wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--problems", type=int, default=64)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--problem", type=int, default=256)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    gpus = int(os.environ.get("WORLD_SIZE", "1"))
    par = init_parallel(tensor_parallel=1, data_parallel=gpus, device="cuda", timeout_s=1800)
    model = LlamaFamilyModel.random(config_of(args.shape), dtype=torch.bfloat16, device=par.device)
    batch = inputs(args, model.vocab_size, seed=0)
    warm = inputs(args, model.vocab_size, seed=1)  # the same sizes: kernels compiled, graphs captured
    tokens = args.problems * args.samples * args.new
    one = None
    if par.rank == 0:
        engine = Engine(model, IdTokenizer())
        timed_batch(engine, warm)
        one, _ = timed_batch(engine, batch)
        del engine
    dist.barrier()
    engine = Engine(model, IdTokenizer(), parallel=par)
    timed_batch(engine, warm)
    dist.barrier()
    wall, mine = timed_batch(engine, batch)
    finish = par.gather(mine)
    walls = par.gather(wall)
    if par.rank == 0:
        row = {"shape": args.shape, "problems": args.problems, "samples": args.samples, "prefix": args.prefix,
               "problem": args.problem, "new": args.new, "dp": gpus, "one_gpu_s": one, "dp_s": max(walls),
               "speedup_vs_1gpu": one / max(walls), "one_gpu_tok_s": tokens / one, "dp_tok_s": tokens / max(walls),
               "replica_finish_s": finish, "replica_imbalance": max(finish) / (sum(finish) / len(finish))}
        result = {"benchmark": "run_batch_dp", "devices": [torch.cuda.get_device_name(i) for i in range(gpus)],
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
                  "method": "wall time of one run_batch (prefill included), after a warm-up batch of the same sizes "
                            "(other tokens); replica_finish_s: when each replica's own programs were all done",
                  "rows": [row]}
        out = Path(args.out or Path(__file__).parent / "results" / f"run_batch_dp{gpus}_{args.shape}.json")
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
