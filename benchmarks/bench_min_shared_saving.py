"""When is a shared node worth its own attention step? The measurement behind ``DEFAULT_MIN_SHARED_SAVING``.

:func:`treegen.tree.passes.simplify` dissolves a shared node of ``t`` tokens with ``b`` branches below it
into its children (each child then holds a copy of its tokens) when sharing saves fewer than
``min_saving`` KV token reads per decode step, ``(b - 1) * t``: a shared node costs one more segment
(a partial attention and a log-sum-exp merge per query), a dissolved one re-reads its keys once per
branch. This times one decode step's tree attention (one layer, CUDA-graphed, L2 flushed between
trials) of a two-level tree — a root of ``--prefix`` tokens, ``--middles`` nodes of ``t`` tokens below
it, ``b`` leaves of ``--leaf`` tokens below each (one decode query per leaf) — with the middle level
shared and dissolved, over ``t`` in 1..256 and ``b`` in 2..64, for the head shapes of Llama-3-8B
(32/8 x 128) and TinyLlama (32/4 x 64), bf16. ``simplify``'s rule is one threshold on the saving, so
the result is the threshold whose choices cost least over every point and shape: the geometric mean of
(chosen layout's time / the faster layout's), with the thresholds within ``--flat`` of that best (the
time does not follow ``(b - 1) * t`` alone: with 2 branches sharing never won, and with 64 it lost at
small ``t``). ``--summarize FILE`` recomputes that from a result's rows.

Both layouts hold the same keys and values, so the two outputs must agree: ``--check`` compares them on
the CPU with the PyTorch reference (no timing; what CI-less machines can run).

    python benchmarks/bench_min_shared_saving.py            # GPU: writes results/min_shared_saving_<gpu>.json
    python benchmarks/bench_min_shared_saving.py --check    # CPU: the two layouts agree
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from bench_attention import bench, layered_layout, result_header, tree_inputs  # benchmarks/
from treegen.kernels.tree_attention import plan_tree_attention, tree_attention

MIDDLE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BRANCHES = (2, 4, 8, 16, 32, 64)
SHAPES = {"llama3-8b": (32, 8, 128), "tinyllama-1.1b": (32, 4, 64)}  # query heads, KV heads, head dim


def layouts(prefix: int, middles: int, t: int, b: int, leaf: int, heads: int, kv_heads: int, head_dim: int,
            dtype, device):
    """The queries, and for each layout ("shared", "dissolved") its (k, v, plan): the same keys and values
    per token, laid out with the middle nodes as segments of their own or copied into every leaf."""
    g = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randn(n, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)

    root_kv = (rand(prefix), rand(prefix))
    middle_kv = [(rand(t), rand(t)) for _ in range(middles)]
    leaf_kv = [[(rand(leaf), rand(leaf)) for _ in range(b)] for _ in range(middles)]
    q = torch.randn(middles * b, heads, head_dim, generator=g).to(device=device, dtype=dtype)
    out = {}
    for name in ("shared", "dissolved"):
        if name == "shared":
            parent, length, leaves = layered_layout([(1, prefix), (middles, t), (b, leaf)])
            pieces = [root_kv, *middle_kv, *(kv for m in leaf_kv for kv in m)]
        else:
            parent, length, leaves = layered_layout([(1, prefix), (middles * b, t + leaf)])
            pieces = [root_kv, *((torch.cat([middle_kv[m][0], kv[0]]), torch.cat([middle_kv[m][1], kv[1]]))
                                 for m in range(middles) for kv in leaf_kv[m])]
        start, pos, _, query_pos = tree_inputs(parent, length, leaves)
        k = torch.cat([p[0] for p in pieces])
        v = torch.cat([p[1] for p in pieces])
        plan = plan_tree_attention(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                                   query_segment=leaves, query_pos=query_pos, device=device, num_heads=heads,
                                   num_kv_heads=kv_heads, dtype=dtype)
        out[name] = (k, v, plan)
    return q, out


def check(prefix: int, middles: int, leaf: int) -> None:
    """On the CPU (PyTorch reference): both layouts give the same attention output."""
    for t in (1, 16):
        for b in (2, 4):
            q, lay = layouts(prefix, middles, t, b, leaf, 4, 2, 16, torch.float32, "cpu")
            shared, dissolved = (tree_attention(q, k, v, plan, 16**-0.5) for k, v, plan in lay.values())
            err = (shared - dissolved).abs().max().item()
            assert err < 1e-5, (t, b, err)
            print(f"t={t} b={b}: shared and dissolved agree (max |diff| {err:.1e})")


def summarize(rows: list[dict], flat: float) -> dict:
    """The threshold on ``saving`` whose choices (share when the saving reaches it) cost least: the
    geometric mean over ``rows`` of chosen time / best time; and the thresholds within ``flat`` of it."""
    def cost(threshold):
        ratios = [(r["shared_us"] if r["saving"] >= threshold else r["dissolved_us"]) / min(r["shared_us"], r["dissolved_us"])
                  for r in rows]
        return math.exp(sum(map(math.log, ratios)) / len(ratios)), max(ratios)

    costs = {s: cost(s) for s in sorted({0, *(r["saving"] for r in rows)})}
    best = min(costs, key=lambda s: costs[s][0])
    near = [s for s, (c, _) in costs.items() if c <= costs[best][0] * (1 + flat)]
    return {"best_threshold": best, "best_mean_over_fastest": costs[best][0], "best_worst_over_fastest": costs[best][1],
            "thresholds_within_flat": near, "flat": flat,
            "mean_over_fastest_by_threshold": {str(s): round(c, 4) for s, (c, _) in costs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--middles", type=int, default=8)
    parser.add_argument("--leaf", type=int, default=32)
    parser.add_argument("--flat", type=float, default=0.002, help="thresholds this close to the best are reported as even")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--summarize", default=None, help="a result file: recompute its summary from its rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.check:
        check(args.prefix, args.middles, args.leaf)
        return
    if args.summarize:
        path = Path(args.summarize)
        result = json.loads(path.read_text())
        result.pop("break_even_saving", None), result.pop("largest_saving_where_sharing_is_slower", None), result.pop("tolerance", None)
        result.update(summarize(result["rows"], args.flat))
        path.write_text(json.dumps(result, indent=2) + "\n")
        print({k: v for k, v in result.items() if k.startswith(("best", "thresholds"))})
        return
    rows = []
    for shape, (heads, kv_heads, head_dim) in SHAPES.items():
        for t in MIDDLE_TOKENS:
            for b in BRANCHES:
                q, lay = layouts(args.prefix, args.middles, t, b, args.leaf, heads, kv_heads, head_dim,
                                 torch.bfloat16, "cuda")
                outs = [tree_attention(q, k, v, plan, head_dim**-0.5) for k, v, plan in lay.values()]
                err = (outs[0].float() - outs[1].float()).abs().max().item()
                if err > 3e-2:  # (bf16: the same keys, merged in another order)
                    raise AssertionError(f"{shape} t={t} b={b}: shared and dissolved differ by {err}")
                us = {name: 1e3 * bench(lambda k=k, v=v, plan=plan: tree_attention(q, k, v, plan, head_dim**-0.5))
                      for name, (k, v, plan) in lay.items()}
                rows.append({"shape": shape, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                             "middle_tokens": t, "branches": b, "saving": (b - 1) * t,
                             "shared_us": us["shared"], "dissolved_us": us["dissolved"],
                             "shared_over_dissolved": us["shared"] / us["dissolved"]})
                print(json.dumps(rows[-1]), flush=True)
    result = {**result_header("min_shared_saving", "triton.testing.do_bench median of a CUDA-graphed call, L2 flushed"),
              "prefix": args.prefix, "middles": args.middles, "leaf": args.leaf, "rows": rows,
              **summarize(rows, args.flat)}
    gpu = "h200" if "H200" in result["device"] else "h100"
    out = Path(args.out or Path(__file__).parent / "results" / f"min_shared_saving_{gpu}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"best threshold {result['best_threshold']} (choices {result['best_mean_over_fastest']:.4f}x the faster "
          f"layout on average, {result['best_worst_over_fastest']:.2f}x at worst; within {args.flat:.1%}: "
          f"{result['thresholds_within_flat']}); wrote {out}")


if __name__ == "__main__":
    main()
