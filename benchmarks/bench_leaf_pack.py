"""Decode leaves several to a tile against one leaf a tile, same tree, same run (GPU).

The paper-grid decode shape (one shared prefix over ``batch`` leaves of ``suffix`` keys, one query each) for
each head configuration and KV format: tree attention with the plan's default (``pack_leaves`` None: as many
leaves as fill a 16-row tile) and with ``pack_leaves=1``, each timed as a CUDA-graph replay with L2 flushed
(``bench_attention.bench``); also the call's floor (unique KV bytes at HBM peak or FLOPs at 80% of the
tensor-core peak, whichever is larger).

    python benchmarks/bench_leaf_pack.py [--batches 128 256 1024] [--suffixes 32 128] [--heads 32/8x128 ...]

JSON ``benchmarks/results/leaf_pack_<gpu>.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from plotting import pyplot, save  # benchmarks/
from bench_attention import PEAK_BF16_TFLOPS, PEAK_HBM_TBS, bench, layered_layout, result_header, tree_inputs  # benchmarks/
from treegen.kernels.kv_quant import kv_format, quantize_reference
from treegen.kernels.tree_attention import plan_tree_attention, tree_attention


def decode_case(batch: int, prefix: int, suffix: int, heads: int, kv: int, head_dim: int, kv_dtype: str):
    """The paper-grid decode shape on the GPU: ``(tree, q, k, v, scales, fmt)`` — ``tree`` the keyword arguments of
    :func:`plan_tree_attention` but its options, bf16 queries, the cache in ``kv_dtype`` (auto: bf16) and an
    8-bit cache's scales (``()`` for bf16)."""
    parent, length, leaves = layered_layout([(1, prefix), (batch, suffix)])
    start, pos, slots, query_pos = tree_inputs(parent, length, leaves)
    tree = dict(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                query_segment=leaves, query_pos=query_pos, device="cuda", num_heads=heads, num_kv_heads=kv)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k16, v16 = (torch.randn(slots, kv, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fmt = kv_format(None if kv_dtype == "auto" else kv_dtype, torch.bfloat16, "cuda")
    if not fmt.quantized:
        return tree, q, k16, v16, (), fmt
    (k, ks), (v, vs) = quantize_reference(k16, fmt), quantize_reference(v16, fmt)
    return tree, q, k, v, (ks, vs), fmt


def measure(batch: int, prefix: int, suffix: int, heads: int, kv: int, head_dim: int, kv_dtype: str) -> dict:
    tree, q, k, v, scales, fmt = decode_case(batch, prefix, suffix, heads, kv, head_dim, kv_dtype)
    length, query_pos = tree["segment_len"], tree["query_pos"]
    row = {"batch": batch, "prefix": prefix, "suffix": suffix, "heads": heads, "kv_heads": kv, "head_dim": head_dim,
           "kv_dtype": fmt.name}
    outs = {}
    for name, pack in (("packed", None), ("one_leaf", 1)):
        plan = plan_tree_attention(**tree, dtype=q.dtype, triton_options={"pack_leaves": pack})
        row[f"{name}_pack"] = plan.triton.launches[-1].pack
        row[f"{name}_us"] = bench(lambda: tree_attention(q, k, v, plan, head_dim**-0.5, *scales)) * 1e3
        outs[name] = tree_attention(q, k, v, plan, head_dim**-0.5, *scales).float()
    row["max_abs_diff"] = float((outs["packed"] - outs["one_leaf"]).abs().max())
    row["speedup"] = row["one_leaf_us"] / row["packed_us"]
    key = "H200" if "H200" in torch.cuda.get_device_name() else "H100"
    kv_bytes = sum(length) * kv * 2 * (head_dim * fmt.bytes_per_value + fmt.scale_bytes)
    flops = 4 * batch * heads * head_dim * (query_pos[0] + 1)
    row["floor_us"] = max(flops / (PEAK_BF16_TFLOPS[key] * 1e12 * 0.8), kv_bytes / (PEAK_HBM_TBS[key] * 1e12)) * 1e6
    row["packed_x_floor"] = row["packed_us"] / row["floor_us"]
    row["one_leaf_x_floor"] = row["one_leaf_us"] / row["floor_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 256, 1024])
    parser.add_argument("--suffixes", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--heads", nargs="+", default=["32/8x128", "24/8x128", "9/3x64", "32/32x128"])
    parser.add_argument("--kv-dtypes", nargs="+", default=["auto", "fp8"], choices=["auto", "int8", "fp8"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot-only", default=None, metavar="JSON", help="redraw the plot of a results file")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return
    rows = []
    for spec in args.heads:
        hk, head_dim = spec.split("x")
        heads, kv = (int(x) for x in hk.split("/"))
        for kv_dtype in args.kv_dtypes:
            for batch in args.batches:
                for suffix in args.suffixes:
                    rows.append(measure(batch, args.prefix, suffix, heads, kv, int(head_dim), kv_dtype))
                    r = rows[-1]
                    print(f"{spec:>10} {r['kv_dtype']:>9} batch {batch:5d} suffix {suffix:4d}: packed x{r['packed_pack']} "
                          f"{r['packed_us']:7.1f} us vs {r['one_leaf_us']:7.1f} ({r['speedup']:.2f}x; floor "
                          f"{r['floor_us']:.1f}: {r['packed_x_floor']:.2f} vs {r['one_leaf_x_floor']:.2f}) "
                          f"diff {r['max_abs_diff']:.1e}", flush=True)
    device = torch.cuda.get_device_name()
    out = Path(args.out or Path(__file__).parent / "results" / f"leaf_pack_{'h200' if 'H200' in device else 'h100'}.json")
    out.write_text(json.dumps({**result_header("leaf_pack", "CUDA-graph replay median (triton do_bench, L2 flushed); "
                                                            "default plan vs pack_leaves=1, same tensors, same run"),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    plot(json.loads(out.read_text()), out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    """Speed-up of the default plan over one leaf a tile, one bar per case, grouped by heads and KV format."""
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(12, 4))
    labels = [f"{r['heads']}/{r['kv_heads']} {r['kv_dtype'][:4]}\n{r['batch']}x{r['suffix']} p{r['packed_pack']}" for r in rows]
    ax.bar(range(len(rows)), [r["speedup"] for r in rows],
           color=["tab:blue" if r["packed_pack"] > 1 else "lightgray" for r in rows])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=5, rotation=90)
    ax.set_ylabel("one leaf a tile / packed (time)")
    ax.set_title(f"Decode leaves packed into 16-row tiles, 2K prefix ({result['device']}; gray: rule keeps one)")
    save(fig, path)


if __name__ == "__main__":
    main()
