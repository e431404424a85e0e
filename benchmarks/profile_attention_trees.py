"""Where tree attention's time goes on program-shaped trees: each launch of one call, against its own floor (GPU).

``bench_attention_trees.py`` times a whole call; this script takes the same trees (its generators) and
reports, per case and plan variant, each kernel launch of one call — the plan's launches in order (tile
height, work items, warps, stages, key block, fused merge, registers and spills), the merge launch and a
library (cuDNN) call — with its GPU time (``torch.profiler`` over CUDA-graph replays, L2 flushed before
each replay, median over replays), the KV bytes it reads and the time those bytes take at HBM peak.

Variants are plan knobs (``plan_triton``'s keyword arguments), each an experiment:

    python benchmarks/profile_attention_trees.py --trees multilevel heavy --leaves 256 --heads 32/8x128 9/3x64 \\
        --variant default --variant tp132:target_programs=132 --variant leaf2:leaf_shape=32,2,2

JSON ``benchmarks/results/profile_attention_trees_<gpu>.json``: a row per case and variant with its
launches.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from bench_attention import PEAK_HBM_TBS, bench  # benchmarks/
from bench_attention_trees import add_case_arguments, cases, empty_kernel_us, layout, make_tree, result_path  # benchmarks/
from treegen.kernels.launch import Launcher
from treegen.kernels.tree_attention import plan_tree_attention, tree_attention
from treegen.runtime.cuda_graph import capture


def parse_variant(text: str) -> tuple[str, dict]:
    """``name[:key=value,key=value]`` → (name, knobs); a value with commas inside ``key=a,b,c`` is not
    possible, so tuples are written with ``/``: ``leaf_shape=32/2/2``."""
    name, _, rest = text.partition(":")
    knobs = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if not value:
            raise SystemExit(f"--variant {text!r}: {item!r} is not KEY=VALUE")
        parts = value.split("/")
        knobs[key] = tuple(int(p) for p in parts) if len(parts) > 1 else int(value)
    return name, knobs


def launch_bytes(work: torch.Tensor, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """KV bytes the items of one launch read (keys + values of every item's key range, every KV head)."""
    w = work.cpu().reshape(-1, 7)  # (a packed launch: several items a program, see WorkList.pack)
    return int((w[:, 3] - w[:, 2]).clamp(min=0).sum()) * kv_heads * head_dim * 2 * itemsize


def variant_registers(plan_launch, group: int, head_dim: int, lib_tail: bool = False) -> tuple:
    """(registers, spills) of the compiled segment-kernel variant with this launch's tile shape (and whether it
    attends the library segment's tail, ``TritonPlan.leaf_tail``), if found."""
    for launcher in Launcher.every:
        for key, kernel in launcher.compiled.items():
            k = dict(key[2]) if len(key) > 2 else {}
            if k.get("BLOCK_M") == plan_launch.block_m and k.get("GROUP") == group and k.get("HEAD_DIM") == head_dim \
                    and k.get("num_warps") == plan_launch.num_warps and k.get("PACK", 1) == plan_launch.pack \
                    and bool(k.get("LIB_TAIL", False)) == lib_tail:
                return getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)
    return None, None


def profile_case(kind: str, leaves: int, heads: int, kv: int, head_dim: int, knobs: dict, replays: int) -> dict:
    f = make_tree(kind, leaves)
    start, pos, slots, query_leaves, query_pos = layout(f)
    n = len(query_leaves)
    torch.manual_seed(0)
    q = torch.randn(n, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(slots, kv, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(slots, kv, head_dim, device="cuda", dtype=torch.bfloat16)
    plan = plan_tree_attention(segment_parent=f.parent, segment_start=start, segment_len=f.length, segment_pos=pos,
                               query_segment=query_leaves, query_pos=query_pos, device="cuda", num_heads=heads,
                               num_kv_heads=kv, dtype=torch.bfloat16, backend="triton", triton_options=knobs or None)
    scale = head_dim**-0.5
    call = lambda: tree_attention(q, k, v, plan, scale)  # noqa: E731
    total_us = bench(call) * 1e3
    graph = capture(call)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    # the kernels between two flushes are one call's, in launch order
    calls, current = [], None
    for e in events:
        if "FillFunctor" in e.name or "fill" in e.name.lower() and "elementwise" in e.name:
            if current:
                calls.append(current)
            current = []
        elif current is not None:
            current.append(e)
    if current:
        calls.append(current)
    per_position = collections.defaultdict(list)
    names = {}
    for c in calls:
        for i, e in enumerate(c):
            per_position[i].append(e.device_time)
            names[i] = e.name
    tp = plan.triton
    key = "H200" if "H200" in torch.cuda.get_device_name() else "H100"
    launches = []
    triton_index = 0
    for i in sorted(per_position):
        name = names[i]
        entry = {"kernel": name[:60], "us": statistics.median(per_position[i])}
        if "_segment_attention_kernel" in name and triton_index < len(tp.launches):
            w = tp.launches[triton_index]
            triton_index += 1
            fused = tp.fused_merge and w.block_m == 16
            tail = tp.leaf_tail[2] if fused else 0  # (every fused program reads the library's tail keys, mostly from L2)
            b = launch_bytes(w.work, kv, head_dim, 2) + tail * kv * head_dim * 2 * 2
            regs, spills = variant_registers(w, tp.group, head_dim, tail > 0)
            entry.update(block_m=w.block_m, items=int(w.work.reshape(-1, 7)[:, 5].gt(0).sum()), pack=w.pack,
                         programs=int(w.work.shape[0]) * kv,
                         block_n=w.block_n, warps=w.num_warps, stages=w.num_stages, direct_rows=w.direct_rows,
                         fused_merge=fused, kv_mb=b / 1e6,
                         kv_floor_us=b / (PEAK_HBM_TBS[key] * 1e12) * 1e6, regs=regs, spills=spills)
        launches.append(entry)
    unique = slots * kv * head_dim * 2 * 2
    return {"tree": kind, "leaves": n, "heads": heads, "kv_heads": kv, "head_dim": head_dim, "nodes": len(f.parent),
            "total_us": total_us, "sum_of_launches_us": sum(e["us"] for e in launches),
            "unique_kv_mb": unique / 1e6, "kv_floor_us": unique / (PEAK_HBM_TBS[key] * 1e12) * 1e6,
            "partials": tp.num_partials, "merge_entries": int(tp.merge_idx.numel()),
            "library": tp.library is not None, "launches": launches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_case_arguments(parser, leaves=[256, 1024])
    parser.add_argument("--variant", action="append", default=None,
                        help="NAME[:KNOB=INT,KNOB=A/B/C] plan_triton knobs (repeatable); default: the runtime's plan")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    variants = [parse_variant(v) for v in (args.variant or ["default"])]
    name = torch.cuda.get_device_name()
    out = result_path(args.out, "profile_attention_trees")
    fixed = empty_kernel_us()
    print(f"empty kernel in a CUDA graph: {fixed:.2f} us", flush=True)
    rows = []
    for kind, leaves, heads, kv, d in cases(args.heads, args.trees, args.leaves):
        for vname, knobs in variants:
            row = profile_case(kind, leaves, heads, kv, d, knobs, args.replays)
            row["variant"], row["knobs"] = vname, {k: list(v) if isinstance(v, tuple) else v for k, v in knobs.items()}
            rows.append(row)
            print(f"\n{kind} {row['leaves']} leaves {heads}/{kv}x{d} [{vname}]: {row['total_us']:.1f} us a call "
                  f"(launches {row['sum_of_launches_us']:.1f}; KV floor {row['kv_floor_us']:.1f} + {fixed:.1f}), "
                  f"{row['partials']} partials, {row['merge_entries']} merge entries")
            for e in row["launches"]:
                extra = "" if "block_m" not in e else (
                    f" m{e['block_m']} n{e['block_n']} w{e['warps']} s{e['stages']} {e['programs']} programs"
                    f"{' fused' if e['fused_merge'] else ''} regs {e['regs']}/{e['spills']} "
                    f"KV {e['kv_mb']:.1f} MB = {e['kv_floor_us']:.1f} us at peak")
                print(f"  {e['us']:7.1f} us  {e['kernel'][:40]}{extra}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "profile_attention_trees", "device": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
        "empty_kernel_us": fixed,
        "method": "torch.profiler kernel times over CUDA-graph replays, L2 flushed before each, median per launch",
        "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
