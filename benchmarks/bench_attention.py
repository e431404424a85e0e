"""Decode attention with a shared prefix: treegen's Triton tree attention vs FlashAttention (GPU).

Each point: `batch` sequences share a `prefix` and each has its own `suffix`; one query token per
sequence. Timed side by side in one run (triton.testing.do_bench, L2 flushed, median):

* flash      — torch SDPA, flash backend, over per-sequence KV (the prefix copied into every sequence);
               GQA folded into the query axis ([B, kv_heads, group, D]), so no KV head is duplicated.
* cudnn      — the same per-sequence KV with the cuDNN backend (a stronger library baseline on Hopper).
* reference  — treegen's PyTorch tree attention (one batched attention per tree level + LSE merge).
* treegen    — treegen's kernels as the runtime plans them (Triton segment partials + path merge, and the
               large shared prefix by cuDNN's fused attention on Hopper), planned once, excluded from timing;
               ``triton_only`` is the same plan with every segment on the Triton kernels.

Also MHA / GQA shapes, and a two-level tree (2K few-shot root, 16 problems of 512 tokens, 64 samples
each) against the same workload planned as one level. Prints a table, writes JSON (device and versions)
and a PNG plot of the speedup over FlashAttention under benchmarks/results/.

    python benchmarks/bench_attention.py [--quick] [--out-dir benchmarks/results]
    python benchmarks/bench_attention.py --kv-quant    # the same kernels over an INT8 / FP8 KV cache vs bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from treegen.kernels.tree_attention import plan_tree_attention, tree_attention, tree_attention_reference
from treegen.runtime.cuda_graph import capture
from plotting import pyplot, save  # benchmarks/plotting.py (a script's own folder is on sys.path)

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16 tensor-core peak (SXM)
PEAK_HBM_TBS = {"H100": 3.35, "H200": 4.8}


def bench(fn, graph: bool = True) -> float:
    """Median ms of ``fn`` with L2 flushed between trials; ``graph``: replay a CUDA graph of it (as the
    runtime's decode step does), so host launch overhead is not what is measured."""
    if graph:
        fn = capture(fn).replay
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def layered_layout(levels: list[tuple[int, int]]):
    """A uniform forest: ``levels = [(fanout, tokens per node), ...]``; the first fanout is the number of
    roots, the last level holds the leaves. E.g. [(1, 2048), (16, 512), (64, 32)] → one 2K root, 16
    problems below it, 64 samples of 32 tokens below each problem."""
    parent, length, frontier = [], [], [-1]
    for fanout, tokens in levels:
        nxt = []
        for node in frontier:
            for _ in range(fanout):
                parent.append(node)
                length.append(tokens)
                nxt.append(len(parent) - 1)
        frontier = nxt
    return parent, length, frontier


def tree_inputs(parent, length, leaves):
    start, pos, cursor = [], [], 0
    for s in range(len(parent)):
        start.append(cursor)
        cursor += length[s]
        pos.append(0 if parent[s] == -1 else pos[parent[s]] + length[parent[s]])
    query_pos = [pos[s] + length[s] - 1 for s in leaves]
    return start, pos, cursor, query_pos


SWEEP_POINTS = ((1024, 16384), (256, 16384), (1024, 4096), (64, 16384), (64, 1024))


def sweep(dtype, heads: int = 8, kv: int = 1, points=SWEEP_POINTS, suffix: int = 32) -> list[dict]:
    """Triton tuning knobs at a few paper-grid points (d=128): time of each configuration."""
    out = []
    for batch, prefix in points:
        parent, length, leaves = layered_layout([(1, prefix), (batch, suffix)])
        start, pos, slots, query_pos = tree_inputs(parent, length, leaves)
        q = torch.randn(batch, heads, 128, device="cuda", dtype=dtype)
        k, v = (torch.randn(slots, kv, 128, device="cuda", dtype=dtype) for _ in range(2))
        configs = [(264, 64, 3, False, False), (264, 64, 3, True, False), (264, 64, 3, True, True),
                   (264, 128, 3, True, False), (264, 128, 2, True, True), (132, 64, 3, True, False),
                   (528, 64, 3, True, False), (132, 128, 3, True, False)]
        for target, block_n, stages, tma, ws in configs:
            opts = dict(target_programs=target, block_n=block_n, num_stages=stages, use_tma=tma, warp_specialize=ws)
            plan = plan_tree_attention(segment_parent=parent, segment_start=start, segment_len=length,
                                       segment_pos=pos, query_segment=leaves, query_pos=query_pos,
                                       device="cuda", num_heads=heads, num_kv_heads=kv, triton_options=opts)
            try:
                ms = bench(lambda: tree_attention(q, k, v, plan, 128**-0.5))
            except Exception as e:  # e.g. out of shared memory, or no warp specialisation on this GPU
                ms = float("nan")
                print("config failed", opts, type(e).__name__, str(e)[:200])
            out.append({"batch": batch, "prefix": prefix, "heads": heads, "kv_heads": kv, **opts, "ms": ms})
            print(out[-1], flush=True)
        best = min((r for r in out if r["batch"] == batch and r["prefix"] == prefix), key=lambda r: r["ms"])
        print("best", best, flush=True)
    return out


def run_point(*, batch, prefix, suffix, heads, kv, head_dim, dtype, with_reference=True, levels=None):
    """One point: a root of `prefix` tokens with `batch` leaves of `suffix` tokens, or `levels` (see
    :func:`layered_layout`; `batch` must equal its number of leaves)."""
    parent, length, leaves = layered_layout(levels or [(1, prefix), (batch, suffix)])
    assert len(leaves) == batch
    start, pos, slots, query_pos = tree_inputs(parent, length, leaves)
    total = query_pos[0] + 1  # tokens per sequence
    dev = "cuda"
    q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
    k_cache = torch.randn(slots, kv, head_dim, device=dev, dtype=dtype)
    v_cache = torch.randn(slots, kv, head_dim, device=dev, dtype=dtype)
    scale = head_dim**-0.5
    common = dict(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                  query_segment=leaves, query_pos=query_pos, device=dev, num_heads=heads, num_kv_heads=kv)
    plan = plan_tree_attention(**common, dtype=dtype)
    assert plan.backend == "triton"
    row = {"batch": batch, "prefix": prefix, "suffix": suffix, "heads": heads, "kv_heads": kv, "head_dim": head_dim,
           "library_chunks": plan.triton.library.chunks if plan.triton.library else 0}
    row["treegen_ms"] = bench(lambda: tree_attention(q, k_cache, v_cache, plan, scale))
    row["treegen_eager_ms"] = bench(lambda: tree_attention(q, k_cache, v_cache, plan, scale), graph=False)
    triton_only = plan_tree_attention(**common, dtype=dtype, triton_options={"library": False})
    row["triton_only_ms"] = bench(lambda: tree_attention(q, k_cache, v_cache, triton_only, scale))
    if plan.triton.fused_merge:  # where the time goes: the shared segments (library kernel and wide launches)
        shared = dataclasses.replace(plan, triton=dataclasses.replace(  # alone, then the rest (the leaf launch,
            plan.triton, launches=tuple(w for w in plan.triton.launches if w.block_m != 16)))  # merging)
        row["shared_ms"] = bench(lambda: tree_attention(q, k_cache, v_cache, shared, scale))
        row["leaf_ms"] = row["treegen_ms"] - row["shared_ms"]

    # FlashAttention over per-sequence KV: gather each leaf's root-to-leaf slots (a copy per sequence)
    paths = []
    for leaf in leaves:
        chain, cur = [], leaf
        while cur != -1:
            chain.append(cur)
            cur = parent[cur]
        paths.append(torch.cat([torch.arange(start[s], start[s] + length[s]) for s in reversed(chain)]))
    idx = torch.stack(paths).to(dev)  # [B, total]
    group = heads // kv
    k_seq = k_cache[idx].permute(0, 2, 1, 3).contiguous()  # [B, kv, total, D]
    v_seq = v_cache[idx].permute(0, 2, 1, 3).contiguous()
    q_seq = q.view(batch, kv, group, head_dim)  # GQA folded into the query axis (decode: all keys visible)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = lambda: F.scaled_dot_product_attention(q_seq, k_seq, v_seq, scale=scale)  # noqa: E731
        want = flash().reshape(batch, heads, head_dim)
        row["flash_ms"] = bench(flash)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["cudnn_ms"] = bench(lambda: F.scaled_dot_product_attention(q_seq, k_seq, v_seq, scale=scale))
    except RuntimeError as e:  # no cuDNN attention for this device/shape
        print("cudnn baseline unavailable:", str(e)[:120])
    k_seq = v_seq = None  # the per-sequence copies are large: free them before the next timing
    got = tree_attention(q, k_cache, v_cache, plan, scale)
    row["max_abs_err_vs_flash"] = float((got.float() - want.float()).abs().max())
    if with_reference:
        ref_plan = plan_tree_attention(**common, backend="reference")
        # the reference is timed as launched eagerly, the way its users (the CPU path) run it
        row["reference_ms"] = bench(lambda: tree_attention_reference(q, k_cache, v_cache, ref_plan, scale), graph=False)
    flops = 4 * batch * heads * head_dim * total
    unique_kv_bytes = sum(length) * kv * head_dim * 2 * q.element_size()
    row["treegen_tflops"] = flops / row["treegen_ms"] / 1e9
    row["speedup_vs_flash"] = row["flash_ms"] / row["treegen_ms"]
    if "cudnn_ms" in row:
        row["speedup_vs_cudnn"] = row["cudnn_ms"] / row["treegen_ms"]
    if "reference_ms" in row:
        row["speedup_vs_reference"] = row["reference_ms"] / row["treegen_ms"]
    name = torch.cuda.get_device_name()
    key = "H200" if "H200" in name else "H100"
    floor_ms = max(flops / (PEAK_BF16_TFLOPS[key] * 1e12 * 0.8), unique_kv_bytes / (PEAK_HBM_TBS[key] * 1e12)) * 1e3
    row["floor_ms"] = floor_ms
    row["fraction_of_floor"] = floor_ms / row["treegen_ms"]
    q = k_cache = v_cache = None  # free before the next point
    torch.cuda.empty_cache()
    return row


def run_kv_quant_point(*, batch, prefix, suffix, heads, kv, head_dim, formats=("auto", "int8", "fp8")):
    """One root of `prefix` tokens with `batch` leaves of `suffix` tokens, bf16 queries: treegen's kernels over
    a bf16 cache vs an 8-bit one (INT8 / FP8 with a scale per token and KV head), same tree, same values. For
    each format: median ms, its physical floor (the unique KV bytes it reads at HBM peak, or the FLOPs at
    tensor-core peak) and the ratio to the bf16 cache."""
    from treegen.kernels.kv_quant import kv_format, quantize_reference

    parent, length, leaves = layered_layout([(1, prefix), (batch, suffix)])
    start, pos, slots, query_pos = tree_inputs(parent, length, leaves)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k16, v16 = (torch.randn(slots, kv, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    common = dict(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                  query_segment=leaves, query_pos=query_pos, device="cuda", num_heads=heads, num_kv_heads=kv)
    name = torch.cuda.get_device_name()
    key = "H200" if "H200" in name else "H100"
    flops = 4 * batch * heads * head_dim * (query_pos[0] + 1)
    rows = []
    from treegen.kernels import tree_attention_triton as kernels

    default = kernels.FP8_PRODUCTS
    # an FP8 cache's products in the query dtype (bf16) or in fp16 (the default: see FP8_PRODUCTS)
    variants = {"auto": ["bf16"], "int8": ["bf16"], "fp8": ["query", "fp16"]}
    for kv_dtype, products in ((d, v) for d in formats for v in variants[d]):
        kernels.FP8_PRODUCTS = products
        f = kv_format(None if kv_dtype == "auto" else kv_dtype, torch.bfloat16, "cuda")
        if f.quantized:
            (k, ks), (v, vs) = quantize_reference(k16, f), quantize_reference(v16, f)
        else:
            k, v, ks, vs = k16, v16, None, None
        # as the runtime plans (8-bit: a large prefix dequantized for cuDNN, by the rule measured for 8-bit caches)
        plan = plan_tree_attention(**common, dtype=q.dtype, kv_quantized=f.quantized)
        ms = bench(lambda: tree_attention(q, k, v, plan, head_dim**-0.5, ks, vs))
        triton_only = plan_tree_attention(**common, dtype=None)
        triton_ms = bench(lambda: tree_attention(q, k, v, triton_only, head_dim**-0.5, ks, vs))
        shared_ms = None
        if plan.triton.fused_merge:  # where the time goes: the shared prefix alone (the rest is the leaves' launch)
            shared = dataclasses.replace(plan, triton=dataclasses.replace(
                plan.triton, launches=tuple(w for w in plan.triton.launches if w.block_m != 16)))
            shared_ms = bench(lambda: tree_attention(q, k, v, shared, head_dim**-0.5, ks, vs))
        kv_bytes = sum(length) * kv * 2 * (head_dim * f.bytes_per_value + f.scale_bytes)
        floor_ms = max(flops / (PEAK_BF16_TFLOPS[key] * 1e12 * 0.8), kv_bytes / (PEAK_HBM_TBS[key] * 1e12)) * 1e3
        rows.append({"kv_dtype": f.name, "products": products, "batch": batch, "prefix": prefix, "suffix": suffix, "heads": heads,
                     "kv_heads": kv, "head_dim": head_dim, "treegen_ms": ms, "triton_only_ms": triton_ms, "floor_ms": floor_ms,
                     "fraction_of_floor": floor_ms / ms, "library_chunks": plan.triton.library.chunks if plan.triton.library else 0,
                     "shared_ms": shared_ms, "leaf_ms": None if shared_ms is None else ms - shared_ms})
        print(rows[-1], flush=True)
    kernels.FP8_PRODUCTS = default
    for r in rows:
        r["speedup_vs_bf16_kv"] = rows[0]["treegen_ms"] / r["treegen_ms"]
    q = k16 = v16 = None
    torch.cuda.empty_cache()
    return rows


def leaf_shape_sweep(batches=(256, 1024), prefix=2048, suffix=128, heads=32, kv=8, head_dim=128):
    """The many-leaves launch's (block_n, warps, stages), with and without TMA loads, per KV format at the
    Llama-3-8B decode shape: the leaves' own keys are most of the bytes there, so this launch is where 8-bit
    KV must pay off. ``leaf_ms``: the whole call less the call without the leaves' launch."""
    from treegen.kernels.kv_quant import kv_format, quantize_reference

    out = []
    for batch in batches:
        parent, length, leaves = layered_layout([(1, prefix), (batch, suffix)])
        start, pos, slots, query_pos = tree_inputs(parent, length, leaves)
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        k16, v16 = (torch.randn(slots, kv, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        common = dict(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                      query_segment=leaves, query_pos=query_pos, device="cuda", num_heads=heads, num_kv_heads=kv,
                      dtype=torch.bfloat16)
        for kv_dtype in ("auto", "int8", "fp8"):
            f = kv_format(None if kv_dtype == "auto" else kv_dtype, torch.bfloat16, "cuda")
            (k, ks), (v, vs) = (quantize_reference(t, f) if f.quantized else (t, None) for t in (k16, v16))
            for tma in (True, False):
                for shape in ((32, 1, 2), (64, 1, 2), (32, 2, 2), (64, 2, 3), (16, 1, 3), (32, 1, 3)):
                    plan = plan_tree_attention(**common, triton_options={"leaf_shape": shape, "use_tma": tma})
                    shared = dataclasses.replace(plan, triton=dataclasses.replace(
                        plan.triton, launches=tuple(w for w in plan.triton.launches if w.block_m != 16)))
                    try:
                        ms = bench(lambda: tree_attention(q, k, v, plan, head_dim**-0.5, ks, vs))
                        leaf_ms = ms - bench(lambda: tree_attention(q, k, v, shared, head_dim**-0.5, ks, vs))
                    except Exception as e:  # e.g. out of shared memory or registers
                        ms = leaf_ms = float("nan")
                        print("leaf shape failed", shape, type(e).__name__, str(e)[:160])
                    leaf_bytes = batch * suffix * kv * 2 * (head_dim * f.bytes_per_value + f.scale_bytes)
                    out.append({"batch": batch, "kv_dtype": f.name, "tma": tma, "block_n": shape[0],
                                "num_warps": shape[1], "num_stages": shape[2], "ms": ms, "leaf_ms": leaf_ms,
                                "leaf_tb_s": leaf_bytes / leaf_ms / 1e9})
                    print(out[-1], flush=True)
        q = k16 = v16 = None
        torch.cuda.empty_cache()
    return out


def kv_quant_main(out_dir: Path, leaf_sweep: bool = False) -> None:
    """The paper grid (8/1 heads) and the Llama-3-8B decode shape (32/8) with 8-bit KV vs bf16 KV."""
    run_kv_quant_point(batch=64, prefix=1024, suffix=32, heads=8, kv=1, head_dim=128)  # warm-up, discarded
    rows = []
    points = [(b, p, 32, 8, 1) for b in (64, 256, 1024) for p in (1024, 4096, 16384)]
    points += [(b, 2048, 128, 32, 8) for b in (128, 256, 512, 1024)]  # Llama-3-8B decode: prefix 2048, 128 own
    for b, p, s, h, kv in points:
        rows += run_kv_quant_point(batch=b, prefix=p, suffix=s, heads=h, kv=kv, head_dim=128)
    leaf_sweep = leaf_shape_sweep() if leaf_sweep else []
    keys = ["kv_dtype", "products", "batch", "prefix", "suffix", "heads", "kv_heads", "treegen_ms", "triton_only_ms", "shared_ms",
            "leaf_ms", "floor_ms", "fraction_of_floor", "speedup_vs_bf16_kv", "library_chunks"]
    print("\n## Tree attention over an 8-bit KV cache vs bf16 (bf16 queries, d=128)\n" + fmt(rows, keys))
    result = {
        **result_header("kv_quant_attention", "triton.testing.do_bench median (L2 flushed), CUDA graphs; floor = "
                        "max(FLOPs at 80% of the bf16 tensor-core peak, unique KV bytes (values + scales) at HBM peak)"),
        "rows": rows, "leaf_shape_sweep": leaf_sweep,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "kv_quant_attention_" + ("h200" if "H200" in result["device"] else "h100")
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_dir}/{name}.json")


def result_header(benchmark: str, timing: str) -> dict:
    """What every result JSON of this script starts with: the device, versions, date and timing method."""
    return {"benchmark": benchmark, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "dtype": "bfloat16",
            "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                         "python": platform.python_version()},
            "timing": timing}


def fmt(rows, keys):
    head = "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys)
    lines = [head]
    for r in rows:
        lines.append("| " + " | ".join(f"{r.get(k):.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few points only")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="only time the Triton tuning knobs")
    parser.add_argument("--sweep-heads", type=int, nargs=2, default=[8, 1], metavar=("Q", "KV"))
    parser.add_argument("--sweep-points", nargs="+", default=None, help="BATCHxPREFIX, e.g. 256x2048")
    parser.add_argument("--sweep-suffix", type=int, default=32)
    parser.add_argument("--kv-quant", action="store_true", help="only the 8-bit KV comparison (kv_quant_attention_*.json)")
    parser.add_argument("--leaf-sweep", action="store_true", help="with --kv-quant: also sweep the leaves' launch shape")
    args = parser.parse_args()
    dtype = torch.bfloat16
    if args.kv_quant:
        kv_quant_main(Path(args.out_dir), args.leaf_sweep)
        return
    if args.sweep:
        points = [tuple(map(int, p.split("x"))) for p in args.sweep_points] if args.sweep_points else SWEEP_POINTS
        rows = sweep(dtype, *args.sweep_heads, points=points, suffix=args.sweep_suffix)
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.out_dir) / "attention_sweep.json").write_text(json.dumps(rows, indent=1))
        return
    grid = [(b, p, s) for b in (64, 256, 1024) for p in (1024, 4096, 16384) for s in (32, 256)]
    if args.quick:
        grid = [(64, 1024, 32), (1024, 16384, 32)]
    # warm-up, discarded: the first point of a fresh process measured 2x slow once (41 vs 20 us at 64 / 1K / 32)
    run_point(batch=64, prefix=1024, suffix=32, heads=8, kv=1, head_dim=128, dtype=dtype, with_reference=False)
    rows = []
    for b, p, s in grid:
        rows.append(run_point(batch=b, prefix=p, suffix=s, heads=8, kv=1, head_dim=128, dtype=dtype,
                              with_reference=not args.no_reference))
        print(rows[-1], flush=True)
    keys = ["batch", "prefix", "suffix", "flash_ms", "cudnn_ms", "reference_ms", "treegen_ms", "triton_only_ms",
            "library_chunks", "shared_ms", "leaf_ms", "speedup_vs_flash", "speedup_vs_cudnn", "speedup_vs_reference",
            "treegen_tflops", "fraction_of_floor", "max_abs_err_vs_flash"]
    print("\n## Paper grid: 8 query heads, 1 KV head, d=128, bf16\n" + fmt(rows, keys))

    shapes = []
    for heads, kv in ((32, 32), (32, 8)):
        points = ((64, 4096, 32), (256, 4096, 32)) + (((1024, 2048, 64),) if kv == 8 else ())  # Llama-3-8B decode
        for b, p, s in points if not args.quick else ((64, 4096, 32),):
            shapes.append(run_point(batch=b, prefix=p, suffix=s, heads=heads, kv=kv, head_dim=128, dtype=dtype,
                                    with_reference=False))
            print(shapes[-1], flush=True)
    no_reference = [k for k in keys if k not in ("reference_ms", "speedup_vs_reference", "max_abs_err_vs_flash")]
    print("\n## MHA (32/32) and GQA (32/8), d=128, bf16\n" + fmt(shapes, ["heads", "kv_heads"] + no_reference))

    two = []
    two.append({"layout": "two-level", **run_point(batch=16 * 64, prefix=2048, suffix=32, heads=8, kv=1, head_dim=128,
                                                   dtype=dtype, with_reference=False,
                                                   levels=[(1, 2048), (16, 512), (64, 32)])})
    two.append({"layout": "one-level", **run_point(batch=16 * 64, prefix=2560, suffix=32, heads=8, kv=1, head_dim=128,
                                                   dtype=dtype, with_reference=False,
                                                   levels=[(16, 2560), (64, 32)])})
    print("\n## Two-level tree: 2K root, 16 problems x 512, 64 samples each, suffix 32\n"
          + fmt(two, ["layout", "flash_ms", "treegen_ms", "triton_only_ms", "speedup_vs_flash", "treegen_tflops"]))

    result = {
        **result_header("attention", "triton.testing.do_bench median (L2 flushed), warmup 10, rep 50 ms; flash, cudnn "
                        "and treegen replayed from CUDA graphs, the PyTorch reference launched eagerly"),
        "grid": rows, "shapes": shapes, "two_level": two,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = ("attention_quick_" if args.quick else "attention_") + ("h200" if "H200" in result["device"] else "h100")
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.quick:  # the plot is of the whole grid
        plot(rows, out / f"{name}.png", result["device"])
    print(f"wrote {out}/{name}.json")


def plot(rows, path, device):
    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, suffix in zip(axes, (32, 256)):
        for b in (64, 256, 1024):
            pts = [r for r in rows if r["batch"] == b and r["suffix"] == suffix]
            ax.plot([r["prefix"] for r in pts], [r["speedup_vs_flash"] for r in pts], marker="o", label=f"batch {b}")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("shared prefix length")
        ax.set_title(f"suffix {suffix}")
    axes[0].set_ylabel("speedup over FlashAttention (x)")
    axes[0].legend()
    fig.suptitle(f"treegen tree attention vs FlashAttention, 8q/1kv heads, d=128, bf16 — {device}")
    save(fig, path)


if __name__ == "__main__":
    main()
