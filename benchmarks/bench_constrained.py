"""Constrained decoding throughput on one GPU: a regex and a JSON schema against unconstrained sampling, in one run.

Random weights of a real model shape (speed does not depend on the weights), bf16, one shared prompt
below ``batch`` branches sampling at temperature 1, CUDA graphs on. The vocabulary is
:class:`~treegen.runtime.piece_tokenizer.PieceTokenizer`'s synthetic one of the model's size (the
grammar needs token texts; no tokenizer is downloaded). Every branch makes exactly ``new`` tokens:
the unconstrained baseline ignores EOS, and each constraint asks for more text than ``new`` tokens
can hold (so it is never complete and the grammar never allows EOS; such branches end with
``finish_reason="length"``, ``constraint_met=False``):

* ``none``  — no constraint (the decoder's usual phases: host sync every 8 steps, pipelined);
* ``regex`` — ``[a-z0-9 ,.]{N,}`` (N characters at least);
* ``json``  — ``{"reasoning": string of minLength N, "answer": integer}``.

Constrained phases sync with the host every step (each matcher must see its token before the next
mask): the step runs as two CUDA graphs, forward and pick (mask + sample), and the host advances the
matchers and fills step t's masks while step t's forward runs. Decode tok/s = batch * (new - 1) /
(t(new tokens) - t(1 token)), as in bench_end_to_end.py; ``ratio_to_unconstrained`` is against
``none`` at the same batch, in the same run. Every constrained sample is checked: its text is a
prefix the grammar accepts (the matcher took every token) and the JSON starts ``{"reasoning": "``.

    python benchmarks/bench_constrained.py --shape tinyllama-1.1b --batches 64 128 256 512 1024
    python benchmarks/bench_constrained.py --shape llama3-8b --batches 64 128 256 512 1024
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import re
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
import transformers
import triton
from transformers import LlamaConfig

from treegen.runtime.constraint import Constraint
from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.piece_tokenizer import PieceTokenizer
from treegen.runtime.sampler import SamplingParams
from bench_end_to_end import SHAPES  # benchmarks/bench_end_to_end.py

LONGEST_PIECE = 9  # PieceTokenizer's pieces have at most 9 characters (" " + 8 letters)


def constraints(new: int) -> dict[str, Constraint | None]:
    least = LONGEST_PIECE * new + 1  # more characters than `new` tokens can write: never complete
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "minLength": least},
                                               "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    return {"none": None, "regex": Constraint.of(regex=f"[a-z0-9 ,.]{{{least},}}"),
            "json": Constraint.of(json_schema=schema)}


def timed_run(engine: Engine, *, batch: int, prompt: list[int], new: int, constraint) -> tuple[float, list, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    run = engine.start()
    root = run.tree.add_node(None, prompt)
    leaves = [run.tree.add_node(root) for _ in range(batch)]
    params = SamplingParams(max_tokens=new, temperature=1.0, ignore_eos=constraint is None, constraint=constraint)
    results, _ = run.execute([GenRequest(leaf, params, key=i, final=True) for i, leaf in enumerate(leaves)], [])
    torch.cuda.synchronize()
    return time.perf_counter() - start, results, run


def check(results, name: str, new: int) -> None:
    """Every sample made ``new`` tokens; a constrained one is an incomplete, accepted prefix."""
    for r in results:
        assert len(r.tokens) == new, (name, len(r.tokens), r.finish_reason)
        if name != "none":
            # the matcher accepted every token (else the run raised); the text is what the grammar began
            assert r.constraint_met is False and r.finish_reason == "length", (name, r)
        if name == "regex":
            assert re.fullmatch(r"[a-z0-9 ,.]*", r.text), r.text[:80]
        if name == "json":
            assert r.text.startswith('{"reasoning": "'), r.text[:80]


def measure(engine: Engine, name: str, constraint, batch: int, prompt: list[int], new: int) -> dict:
    timed_run(engine, batch=batch, prompt=prompt, new=8, constraint=constraint)  # warm-up: kernels, grammar
    t1, _, _ = timed_run(engine, batch=batch, prompt=prompt, new=1, constraint=constraint)
    tn, results, run = timed_run(engine, batch=batch, prompt=prompt, new=new, constraint=constraint)
    check(results, name, new)
    row = {"constraint": name, "batch": batch, "prefix": len(prompt), "new": new, "total_s": tn, "prefill_s": t1,
           "tok_s": batch * (new - 1) / (tn - t1), "forward_passes": run.forward_passes,
           "constrained_steps": run.decoder.constrained_steps, "decode_phases": len(run.decode_phases),
           "host_accept_s": run.host_seconds["accept"], "host_capture_s": run.host_seconds["capture"],
           "memory_waits": run.scheduler.memory_waits}
    del run, results
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--constraints", nargs="+", default=["none", "regex", "json"], choices=["none", "regex", "json"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    config = LlamaConfig(**SHAPES[args.shape])
    model = LlamaFamilyModel.random(config, dtype=torch.bfloat16, device="cuda")
    tokenizer = PieceTokenizer(config.vocab_size)
    engine = Engine(model, tokenizer)
    prompt = torch.randint(3, config.vocab_size, (args.prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    chosen = {k: v for k, v in constraints(args.new).items() if k in args.constraints}
    compile_s = {}
    for name, c in chosen.items():
        if c is not None:
            started = time.perf_counter()
            engine.grammars.compile(c)
            compile_s[name] = time.perf_counter() - started
    rows = []
    for batch in args.batches:
        for name, c in chosen.items():
            try:
                rows.append(measure(engine, name, c, batch, prompt, args.new))
            except torch.cuda.OutOfMemoryError as e:
                rows.append({"constraint": name, "batch": batch, "skipped": f"out of memory: {str(e)[:200]}"})
                gc.collect()
                torch.cuda.empty_cache()
            base = next((r for r in rows if r["constraint"] == "none" and r["batch"] == batch and "tok_s" in r), None)
            if base and "tok_s" in rows[-1]:
                rows[-1]["ratio_to_unconstrained"] = rows[-1]["tok_s"] / base["tok_s"]
            print(rows[-1], flush=True)
            write_json(args, rows, compile_s)

    names = list(chosen)
    print(f"\n## {args.shape}, bf16, prefix {args.prefix}, {args.new} new tokens, temperature 1 — decode tokens/s "
          "(ratio to unconstrained)\n")
    print("| batch | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for batch in args.batches:
        by = {r["constraint"]: r for r in rows if r["batch"] == batch}
        cells = [f"{by[n]['tok_s']:,.0f} ({by[n].get('ratio_to_unconstrained', 1.0):.2f})" if "tok_s" in by.get(n, {})
                 else "-" for n in names]
        print(f"| {batch} | " + " | ".join(cells) + " |")
    print(f"grammar compile s: {compile_s}")
    print(f"wrote {write_json(args, rows, compile_s)}")


def write_json(args, rows: list[dict], compile_s: dict) -> Path:
    """The results so far (written after every point: a run cut short keeps what it measured)."""
    result = {"benchmark": "constrained", "shape": args.shape, "config": SHAPES[args.shape], "dtype": "bfloat16",
              "device": torch.cuda.get_device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "transformers": transformers.__version__, "xgrammar": importlib.metadata.version("xgrammar"),
                           "cuda": torch.version.cuda, "python": platform.python_version()},
              "method": "decode tok/s = batch*(new-1)/(t(new)-t(1)); temperature 1; every branch makes exactly new "
                        "tokens (unconstrained: EOS ignored; constrained: the constraint needs more text than new "
                        "tokens hold); one warm-up run per point; CUDA graphs",
              "constraints": {k: (str(v) if v is not None else None) for k, v in constraints(args.new).items()},
              "grammar_compile_s": compile_s, "rows": rows}
    out = Path(args.out or Path(__file__).parent / "results" / f"constrained_{args.shape}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
