"""Decode attention on the trees treegen's own programs make, against FlashAttention and the floor (GPU).

The paper grid (``bench_attention.py``) is one shared prefix over uniform leaves. Real programs make
other shapes; this benchmark generates them (deterministic, seeded):

* ``multilevel`` — few-shot prefix → problems → thoughts → sub-thoughts (4 levels, uniform fan-out);
* ``uneven``     — a prefix over problems of random length with skewed (geometric) fan-out;
* ``heavy``      — one heavy subtree (a long document, half the leaves) beside many light problems;
* ``wide``       — a short prefix directly over all leaves, leaf lengths 16 … 512 (wide and shallow);
* ``deep``       — a chain of 5 levels with fan-out 2 … 4 and short nodes (deep merges);
* ``decode``     — one 2K prompt over every leaf, leaves of 1 … 64 tokens (N samples of a prompt mid-generation:
  the end-to-end benchmark's tree).

Each case: one decode query per leaf, bf16, the runtime's plan (planned once, not timed), timed as a
CUDA-graph replay (``triton.testing.do_bench`` median, L2 flushed). Baseline: FlashAttention (torch SDPA,
flash backend) over per-branch KV — each leaf's whole root-to-leaf KV copied into its own sequence,
leaves of equal length batched together (SDPA has no varlen API), every batch in one graph.

Floor: the larger of the unique KV bytes at HBM peak and the FLOPs at 80% of the bf16 tensor-core peak,
plus one kernel's fixed cost (an empty kernel launched inside a CUDA graph on the same GPU, measured
here). ``x_floor`` = treegen / floor.

    python benchmarks/bench_attention_trees.py [--leaves 256 1024] [--trees multilevel wide] [--heads 32/8x128 9/3x64]

JSON ``benchmarks/results/attention_trees_<gpu>.json`` (rows: tree, heads, kv_heads, head_dim, leaves,
levels, unique_kv_tokens, treegen_us, fa_us, floor_us, x_floor, speedup_vs_fa) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_attention import PEAK_BF16_TFLOPS, PEAK_HBM_TBS, bench  # benchmarks/
from plotting import pyplot, save  # benchmarks/
from treegen.kernels.tree_attention import plan_tree_attention, tree_attention
from treegen.kernels.tree_attention_triton import SUPPORTED_HEAD_DIMS

TREES = ("multilevel", "uneven", "heavy", "wide", "deep", "decode")
HEADS = ("32/8x128", "9/3x64", "32/32x128", "16/8x256", "24/8x128")  # Llama-3/Qwen3, SmolLM2, MHA, Gemma 3, Phi


class Forest:
    """A tree built node by node: ``parent`` and ``length`` lists; ``leaves`` get one decode query each."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.length: list[int] = []

    def add(self, parent: int, length: int) -> int:
        self.parent.append(parent)
        self.length.append(max(1, int(length)))
        return len(self.parent) - 1

    @property
    def leaves(self) -> list[int]:
        inner = set(self.parent)
        return [n for n in range(len(self.parent)) if n not in inner]

    def depth(self) -> int:
        best = 0
        for n in range(len(self.parent)):
            d, cur = 0, n
            while cur != -1:
                d, cur = d + 1, self.parent[cur]
            best = max(best, d)
        return best


def make_tree(kind: str, leaves: int, seed: int = 0) -> Forest:
    """A tree of class ``kind`` with about ``leaves`` leaves (exactly, for all but ``uneven``/``deep``)."""
    rng = random.Random(seed)
    f = Forest()
    if kind == "multilevel":  # 2K prefix → 16 problems (256) → 4 thoughts (128) → sub-thoughts (64)
        root = f.add(-1, 2048)
        per_thought = max(1, leaves // 64)
        for _ in range(16):
            p = f.add(root, 256)
            for _ in range(4):
                t = f.add(p, 128)
                for _ in range(per_thought):
                    f.add(t, 64)
    elif kind == "uneven":  # 2K prefix → problems of 64..1024 tokens, geometric fan-out (mean ~leaves/32)
        root = f.add(-1, 2048)
        left = leaves
        while left > 0:
            p = f.add(root, rng.randint(64, 1024))
            fan = min(left, 1 + int(rng.expovariate(1.0 / max(1, leaves // 32))))
            for _ in range(fan):
                f.add(p, rng.randint(16, 256))
            left -= fan
    elif kind == "heavy":  # 1K prefix → one 8K document with half the leaves, and light problems
        root = f.add(-1, 1024)
        doc = f.add(root, 8192)
        for _ in range(leaves // 2):
            f.add(doc, 128)
        light = leaves - leaves // 2
        for _ in range(max(1, light // 4)):
            p = f.add(root, 128)
            for _ in range(4):
                f.add(p, 64)
    elif kind == "wide":  # 512-token prefix directly over every leaf, 16..512 tokens each
        root = f.add(-1, 512)
        for _ in range(leaves):
            f.add(root, rng.randint(16, 512))
    elif kind == "deep":  # 5 levels, fan-out 2..4, short nodes: until about `leaves` leaves
        root = f.add(-1, 1024)
        frontier = [root]
        for level in range(4):
            nxt = []
            for node in frontier:
                for _ in range(rng.randint(2, 4)):
                    nxt.append(f.add(node, rng.randint(32, 256)))
            frontier = nxt
        per = max(1, round(leaves / len(frontier)))
        for node in frontier:
            for _ in range(per):
                f.add(node, rng.randint(16, 128))
    elif kind == "decode":  # N samples of one 2K prompt mid-generation: the prompt over every leaf of 1..64 tokens
        root = f.add(-1, 2048)
        for _ in range(leaves):
            f.add(root, rng.randint(1, 64))
    else:
        raise ValueError(f"unknown tree class {kind!r}; choose from {TREES}")
    return f


def layout(f: Forest):
    """Slots in node order, positions along each root-to-node path; one query at each leaf's last key."""
    start, pos, cursor = [], [], 0
    for n, (p, length) in enumerate(zip(f.parent, f.length)):
        start.append(cursor)
        cursor += length
        pos.append(0 if p == -1 else pos[p] + f.length[p])
    leaves = f.leaves
    return start, pos, cursor, leaves, [pos[n] + f.length[n] - 1 for n in leaves]


def add_case_arguments(parser: argparse.ArgumentParser, leaves: list[int]) -> None:
    """The tree benchmarks' common arguments: tree classes, leaf counts, head specs, output path."""
    parser.add_argument("--trees", nargs="+", default=list(TREES), choices=TREES)
    parser.add_argument("--leaves", type=int, nargs="+", default=leaves)
    parser.add_argument("--heads", nargs="+", default=list(HEADS), help="Q/KVxD, e.g. 32/8x128")
    parser.add_argument("--out", default=None)


def result_path(out: str | None, stem: str) -> Path:
    """``out``, or ``benchmarks/results/<stem>_<gpu>.json`` (e.g. ``attention_trees_h200.json``)."""
    return Path(out or Path(__file__).parent / "results" / f"{stem}_{torch.cuda.get_device_name().split()[1].lower()}.json")


def cases(heads: list[str], trees: list[str], leaves: list[int]):
    """(tree class, leaves, query heads, KV heads, head_dim) for every ``Q/KVxD`` head spec x class x leaf count."""
    for spec in heads:
        qk, d = spec.split("x")
        q, kv = (int(x) for x in qk.split("/"))
        for kind in trees:
            for n in leaves:
                yield kind, n, q, kv, int(d)


@triton.jit
def _empty_kernel(X):
    tl.store(X + tl.program_id(0), 0.0)


def empty_kernel_us() -> float:
    """One empty kernel launched inside a CUDA graph: the fixed cost a launch adds to the floor."""
    x = torch.zeros(1, device="cuda")
    return bench(lambda: _empty_kernel[(1,)](x)) * 1e3


def run_case(kind: str, leaves: int, heads: int, kv: int, head_dim: int, fixed_us: float, fa_budget_gb: float):
    f = make_tree(kind, leaves)
    start, pos, slots, query_leaves, query_pos = layout(f)
    n = len(query_leaves)
    dev, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(n, heads, head_dim, device=dev, dtype=dtype)
    k = torch.randn(slots, kv, head_dim, device=dev, dtype=dtype)
    v = torch.randn(slots, kv, head_dim, device=dev, dtype=dtype)
    scale = head_dim**-0.5
    plan = plan_tree_attention(segment_parent=f.parent, segment_start=start, segment_len=f.length, segment_pos=pos,
                               query_segment=query_leaves, query_pos=query_pos, device=dev, num_heads=heads,
                               num_kv_heads=kv, dtype=dtype,
                               backend="triton" if head_dim in SUPPORTED_HEAD_DIMS else "reference")
    row = {"tree": kind, "heads": heads, "kv_heads": kv, "head_dim": head_dim, "leaves": n, "levels": f.depth(),
           "nodes": len(f.parent), "unique_kv_tokens": slots, "backend": plan.backend}
    row["treegen_us"] = bench(lambda: tree_attention(q, k, v, plan, scale), graph=plan.backend == "triton") * 1e3
    got = tree_attention(q, k, v, plan, scale)

    totals = [p + 1 for p in query_pos]
    flops = 4 * heads * head_dim * sum(totals)
    kv_bytes = slots * kv * head_dim * 2 * q.element_size()
    key = "H200" if "H200" in torch.cuda.get_device_name() else "H100"
    row["floor_us"] = max(flops / (PEAK_BF16_TFLOPS[key] * 1e12 * 0.8), kv_bytes / (PEAK_HBM_TBS[key] * 1e12)) * 1e6 \
        + fixed_us
    row["x_floor"] = row["treegen_us"] / row["floor_us"]

    # FlashAttention over per-branch KV: leaves of equal total length batched together
    copy_bytes = sum(totals) * kv * head_dim * 2 * q.element_size()
    if copy_bytes > fa_budget_gb * 2**30:
        row["fa_skipped"] = f"per-branch KV copy of {copy_bytes / 2**30:.1f} GiB exceeds --fa-budget-gb"
    else:
        paths = []
        for leaf in query_leaves:
            chain, cur = [], leaf
            while cur != -1:
                chain.append(cur)
                cur = f.parent[cur]
            paths.append(torch.cat([torch.arange(start[s], start[s] + f.length[s]) for s in reversed(chain)]))
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(totals):
            groups.setdefault(t, []).append(i)
        batches = []
        for t, rows in groups.items():
            idx = torch.stack([paths[i] for i in rows]).to(dev)
            batches.append((torch.tensor(rows, device=dev), q[rows].view(len(rows), kv, heads // kv, head_dim),
                            k[idx].permute(0, 2, 1, 3).contiguous(), v[idx].permute(0, 2, 1, 3).contiguous()))
        out = torch.empty_like(q)

        def flash():
            for rows, qs, ks, vs in batches:
                out[rows] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).reshape(len(rows), heads, head_dim)

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash()
            row["fa_batches"] = len(batches)
            row["fa_us"] = bench(flash) * 1e3
        row["max_abs_err_vs_fa"] = float((got.float() - out.float()).abs().max())
        row["speedup_vs_fa"] = row["fa_us"] / row["treegen_us"]
        del batches, out
    q = k = v = None
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_case_arguments(parser, leaves=[256, 1024, 4096])
    parser.add_argument("--fa-budget-gb", type=float, default=24.0, help="skip FA where its per-branch KV is larger")
    args = parser.parse_args()
    name = torch.cuda.get_device_name()
    out = result_path(args.out, "attention_trees")
    fixed = empty_kernel_us()
    print(f"empty kernel in a CUDA graph: {fixed:.2f} us", flush=True)
    rows = []
    for kind, leaves, heads, kv, d in cases(args.heads, args.trees, args.leaves):
        row = run_case(kind, leaves, heads, kv, d, fixed, args.fa_budget_gb)
        rows.append(row)
        print(json.dumps(row), flush=True)
        result = {"benchmark": "attention_trees", "device": name, "dtype": "bfloat16",
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "versions": {"torch": torch.__version__, "triton": triton.__version__,
                               "cuda": torch.version.cuda, "python": platform.python_version()},
                  "empty_kernel_us": fixed,
                  "method": "do_bench median (L2 flushed) of a CUDA-graph replay; floor = max(unique KV bytes "
                            "at HBM peak, FLOPs at 80% of bf16 peak) + one empty kernel in a graph",
                  "rows": rows}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, out.with_suffix(".png"), name)
    print(f"wrote {out}")


def plot(rows, path: Path, device: str) -> None:
    """x_floor per case (bars grouped by tree class, one colour per head configuration)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(12, 4))
    labels = [f"{r['tree']}\n{r['leaves']}" for r in rows]
    specs = sorted({(r["heads"], r["kv_heads"], r["head_dim"]) for r in rows})
    for i, spec in enumerate(specs):
        xs = [j for j, r in enumerate(rows) if (r["heads"], r["kv_heads"], r["head_dim"]) == spec]
        ax.bar(xs, [rows[j]["x_floor"] for j in xs], label=f"{spec[0]}/{spec[1]} x {spec[2]}", color=f"C{i}")
    ax.axhline(1.5, color="k", ls="--", lw=1, label="target 1.5x floor")
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("treegen time / floor")
    ax.set_title(f"Tree attention on program-shaped trees, bf16, {device}")
    ax.legend(fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    main()
