"""Two-level sharing on one GPU: P problems x N samples below one few-shot prefix (the Hydragen paper's APPS setup).

A random-weight Llama-7B-shape model (speed does not depend on the weights), bf16, greedy, EOS ignored
so every sample makes exactly ``new`` tokens. Per configuration ``PxN`` the same workload is run three ways,
all on treegen's runtime:

* two   — two-level sharing **detected automatically**: each problem is given as its own root holding
          prefix + problem (what ``run_batch`` sees); :func:`treegen.tree.passes.share_prefixes` finds the
          prefix and :func:`~treegen.tree.passes.simplify` (default threshold) cleans up, then the tree
          prefix -> problem -> N samples is decoded with hierarchical attention;
* single — single-level sharing: the few-shot prefix is shared, each sample holds its own copy of
          its problem;
* flat  — no sharing: every sample holds prefix + problem (FlashAttention / vLLM-style baseline).

Every sample is a *final* request, so a mode whose KV does not fit runs as many branches as fit, the others admitted as finished ones free their KV (branches of
one subtree together, shared KV freed after its last group; :mod:`treegen.runtime.schedule`): each mode
gets the largest batch it fits, and ``groups`` / ``batches`` in the JSON say what ran. Decode throughput = samples * (new - 1) / (t(new) - t(1));
total time (prefill included) reported too. Prints a table, writes JSON (and a PNG when matplotlib is
installed) under benchmarks/results/.

(The simplification threshold itself is measured by ``bench_min_shared_saving.py``; this script's earlier
``--threshold-sweep``, whole decode steps at small batches, is in ``results/two_level_threshold_llama-7b.json``.)

    python benchmarks/bench_two_level.py                                   # default configurations (< 5 min on an H100)
    python benchmarks/bench_two_level.py --configs 4x128 --new 512        # the paper's per-problem size, 4 of its 120 problems
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig

from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.sampler import SamplingParams
from treegen.tree.passes import DEFAULT_MIN_SHARED_SAVING, share_prefixes, simplify
from plotting import pyplot, save, throughput_axes  # benchmarks/plotting.py

SHAPES = {
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000, rope_theta=10000.0, max_position_embeddings=8192),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, rope_theta=10000.0, max_position_embeddings=8192),
}
MODES = ("two", "single", "flat")


def workload(vocab: int, prefix: int, problems: int, problem_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    few_shot = torch.randint(0, vocab, (prefix,), generator=g).tolist()
    # problem lengths vary around problem_len (+-20%), as real problems do
    lens = torch.randint(int(problem_len * 0.8), int(problem_len * 1.2) + 1, (problems,), generator=g).tolist()
    return few_shot, [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def build(run, mode: str, few_shot: list[int], problems: list[list[int]], samples: int) -> tuple[list[int], dict]:
    """Grow ``run.tree`` for ``mode``; returns the leaves to generate into and facts about the tree."""
    tree, leaves, info = run.tree, [], {}
    if mode == "two":
        start = time.perf_counter()
        roots = [tree.add_node(None, few_shot + p) for p in problems]
        for r in roots:
            leaves += [tree.add_node(r) for _ in range(samples)]
        info["shared_nodes"] = len(share_prefixes(tree, roots))
        info["dissolved"] = len(simplify(tree, min_saving=DEFAULT_MIN_SHARED_SAVING, keep=set(roots)).dissolved)
        info["pass_s"] = time.perf_counter() - start
    elif mode == "single":
        root = tree.add_node(None, few_shot)
        for p in problems:
            leaves += [tree.add_node(root, p) for _ in range(samples)]
    else:
        for p in problems:
            leaves += [tree.add_node(None, few_shot + p) for _ in range(samples)]
    info["nodes"] = len(tree.live_nodes())
    return leaves, info


def stored_tokens(mode: str, few_shot, problems, samples: int, new: int) -> int:
    p, lens = len(few_shot), [len(x) for x in problems]
    if mode == "two":
        return p + sum(lens) + len(problems) * samples * new
    if mode == "single":
        return p + samples * sum(lens) + len(problems) * samples * new
    return samples * sum(p + n for n in lens) + len(problems) * samples * new


def sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def timed(engine, model, make, new: int) -> tuple[float, dict]:
    """Build a tree with ``make(run)`` and generate ``new`` tokens into its leaves; seconds, tree facts."""
    sync(model)
    start = time.perf_counter()
    run = engine.start()
    leaves, info = make(run)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    results, _ = run.execute([GenRequest(leaf, params, key=i, final=True) for i, leaf in enumerate(leaves)], [])
    sync(model)
    elapsed = time.perf_counter() - start
    assert all(len(r.tokens) == new for r in results)
    info["memory_waits"] = run.scheduler.memory_waits  # admissions that waited for finished branches' KV
    info["batches"] = sorted(set(run.decode_phases), reverse=True)  # live branches per decode phase
    info["kv_peak_bytes"] = run.kv.num_slots * run.kv.bytes_per_token
    del run, results
    gc.collect()
    return elapsed, info


def measure(engine, model, make, samples: int, new: int) -> dict:
    timed(engine, model, make, min(new, 8))  # warm-up: compile kernels, capture graphs
    t1, _ = timed(engine, model, make, 1)
    tn, info = timed(engine, model, make, new)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return {"total_s": tn, "prefill_s": t1, "decode_tok_s": samples * (new - 1) / (tn - t1), **info}


def run_configs(args, model, engine) -> list[dict]:
    rows = []
    for cfg in args.configs:
        n_problems, samples = map(int, cfg.split("x"))
        few_shot, problems = workload(model.vocab_size, args.prefix, n_problems, args.problem_len)
        for mode in args.modes:
            row = {"mode": mode, "config": cfg, "problems": n_problems, "samples": samples,
                   "sequences": n_problems * samples, "prefix": args.prefix, "problem_len": args.problem_len,
                   "new": args.new, "stored_tokens": stored_tokens(mode, few_shot, problems, samples, args.new)}
            make = lambda run, m=mode: build(run, m, few_shot, problems, samples)  # noqa: E731
            try:
                row |= measure(engine, model, make, n_problems * samples, args.new)
            except MemoryError as e:  # one branch alone does not fit
                row["skipped"] = str(e)
                gc.collect()
                if model.device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
    return rows


def print_table(rows: list[dict], modes) -> None:
    print("\n| config | sequences | " + " | ".join(modes) + " | two / single | two / flat | total time two vs single |")
    print("|---|---|" + "---|" * (len(modes) + 3))
    for cfg in dict.fromkeys(r["config"] for r in rows):
        by = {r["mode"]: r for r in rows if r["config"] == cfg}
        def cell(m):
            r = by.get(m, {})
            if "decode_tok_s" not in r:
                return "does not fit" if r else "-"
            grouped = f", at most {r['batches'][0]} at once (memory)" if r.get("memory_waits") else ""
            return f"{r['decode_tok_s']:,.0f} tok/s ({r['total_s']:.2f} s{grouped})"

        ratio = lambda a, b: (f"{by[a]['decode_tok_s'] / by[b]['decode_tok_s']:.2f}"  # noqa: E731
                              if "decode_tok_s" in by.get(a, {}) and "decode_tok_s" in by.get(b, {}) else "-")
        seqs = next(iter(by.values()))["sequences"]
        both = all("total_s" in by.get(m, {}) for m in ("two", "single"))
        saved = f"{by['two']['total_s'] / by['single']['total_s'] - 1:+.0%}" if both else "-"
        print(f"| {cfg} | {seqs} | " + " | ".join(cell(m) for m in modes)
              + f" | {ratio('two', 'single')} | {ratio('two', 'flat')} | {saved} |")
    print("\nlargest decode batch each mode ran (live branches of its first decode phase):")
    for m in modes:
        ok = [r for r in rows if r["mode"] == m and "decode_tok_s" in r]
        if ok:
            print(f"  {m}: " + ", ".join(f"{r['config']}: {r['batches'][0]}" for r in ok))


def plot(rows: list[dict], modes, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in modes:
        pts = [(r["sequences"], r["decode_tok_s"]) for r in rows if r["mode"] == m and "decode_tok_s" in r]
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", label=m)
    ax.set_title("Two-level sharing: few-shot prefix -> problem -> samples")
    throughput_axes(ax, "sequences (problems x samples)")
    save(fig, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    parser.add_argument("--configs", nargs="+", default=["4x16", "8x16", "8x32", "16x32", "32x32"],
                        help="PROBLEMSxSAMPLES per point (default scaled down from the paper's 120x128)")
    parser.add_argument("--prefix", type=int, default=2400, help="few-shot prefix tokens")
    parser.add_argument("--problem-len", type=int, default=500, help="mean problem tokens")
    parser.add_argument("--new", type=int, default=128, help="new tokens per sample (paper: 512)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    config = LlamaConfig(**SHAPES[args.shape])
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = LlamaFamilyModel.random(config, dtype=dtype, device=args.device)
    engine = Engine(model, IdTokenizer(), cuda_graphs=args.device.startswith("cuda"))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    meta = {"shape": args.shape, "config": SHAPES[args.shape], "dtype": str(dtype).removeprefix("torch."),
            "device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "cuda": torch.version.cuda, "python": platform.python_version()}}
    results = Path(__file__).parent / "results"
    results.mkdir(parents=True, exist_ok=True)
    rows = run_configs(args, model, engine)
    print(f"\n## {args.shape}, {meta['dtype']}, prefix {args.prefix}, problems ~{args.problem_len} tokens, "
          f"{args.new} new tokens — decode tokens/s (total s incl. prefill)")
    print_table(rows, args.modes)
    out = Path(args.out or results / f"two_level_{args.shape}.json")
    out.write_text(json.dumps({"benchmark": "two_level", **meta,
                               "method": "decode tok/s = sequences*(new-1)/(t(new)-t(1)); greedy, EOS ignored; "
                                         "one warm-up run per point", "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    plot(rows, args.modes, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
