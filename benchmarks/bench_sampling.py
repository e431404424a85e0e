"""Drawing a step's tokens: the one-pass kernel (``treegen/kernels/sampling.py``) against the PyTorch ops
the sampler ran before (``sampler.sample`` + the log-probability gather; a mask applied by xgrammar's
kernel first), each captured in a CUDA graph and replayed, in the same run on the same GPU.

Rows ``--batches`` x vocabularies ``--vocabs`` (TinyLlama 32,000, Llama-3 128,256), temperature 1
(``sampled``) or 0 (``greedy``), or temperature 1 with nucleus filtering (``top_p``: top-p 0.95 over the
logits of a language model's shape — a few hundred likely tokens, see ``peaked_logits``; the kernel's
side is ``sampler.pick``: the unfiltered draw, then ``filter_floor``'s search and a second draw where its
token is filtered out), with a
random token bitmask or none. The floor: the logits' bytes
(fp32, read once) at the GPU's HBM peak (``--hbm-tbps``, H100 SXM 3.35).

    python benchmarks/bench_sampling.py --out benchmarks/results/sampling_h100.json
    python benchmarks/bench_sampling.py --plot benchmarks/results/sampling_h100.json   (the plot again)
"""

from __future__ import annotations

import argparse
import functools
import datetime
import json
import platform
from pathlib import Path

import torch
import triton

from treegen.kernels.sampling import gumbel_argmax
from treegen.runtime.sampler import pick, sample
from treegen.runtime.token_masks import apply_bitmask


TOP_P = 0.95


def torch_ops(logits, temperature, keys, steps, bitmask, all_greedy, filtered: bool = False):
    """What ``sampler.pick`` ran before the kernel: mask (in place), sample (``filtered``: top-p ``TOP_P``,
    the floor by a sort), the noise in int64 ops, the log-probability."""
    lse = logits.logsumexp(-1)
    if bitmask is not None:
        apply_bitmask(logits, bitmask)
    tokens = sample(logits, temperature=temperature, keys=keys, steps=steps, all_greedy=all_greedy,
                    **filtered_args(logits.shape[0], logits.device, filtered))
    return tokens, logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse


def kernel(logits, temperature, keys, steps, bitmask, all_greedy):
    tokens, _, logit, lse = gumbel_argmax(logits, temperature, keys, steps, bitmask, all_greedy=all_greedy)
    return tokens, logit - lse


def filtered_args(rows: int, device, filtered: bool = True) -> dict:
    return dict(top_p=torch.full((rows,), TOP_P if filtered else 1.0, device=device),
                top_k=torch.zeros(rows, dtype=torch.int64, device=device), filter_needed=filtered)


def kernel_filtered(logits, temperature, keys, steps, bitmask, all_greedy):
    """Top-p rows as the decode step draws them (``sampler.pick``): the floor by the search kernel, then the one pass."""
    return pick(logits, temperature=temperature, keys=keys, steps=steps, bitmask=bitmask,
                **filtered_args(logits.shape[0], logits.device))


def peaked_logits(rows: int, vocab: int, generator) -> torch.Tensor:
    """Logits shaped like a language model's next-token distribution: a Zipf-like decay over a random order of
    the vocabulary (the top few hundred tokens hold most of the mass) plus noise."""
    rank = torch.argsort(torch.rand(rows, vocab, device="cuda", generator=generator), dim=-1).float()
    return -1.1 * torch.log1p(rank) + 0.5 * torch.randn(rows, vocab, device="cuda", generator=generator) + 8.0


def graphed_us(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]


def plot(result: dict, out: Path) -> None:
    """Kernel and PyTorch-ops microseconds per batch, one panel per vocabulary (sampled and greedy, no mask)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vocabs = sorted({r["vocab"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(vocabs), figsize=(5.5 * len(vocabs), 4), squeeze=False)
    for ax, vocab in zip(axes[0], vocabs):
        for mode, style in (("sampled", "-"), ("greedy", "--"), ("top_p", "-.")):
            rows = sorted((r for r in result["rows"] if r["vocab"] == vocab and r["mode"] == mode and not r["bitmask"]),
                          key=lambda r: r["batch"])
            batches = [r["batch"] for r in rows]
            ax.plot(batches, [r["torch_us"] for r in rows], "o" + style, color="tab:gray", label=f"PyTorch ops, {mode}")
            ax.plot(batches, [r["kernel_us"] for r in rows], "o" + style, color="tab:blue", label=f"kernel, {mode}")
            if mode == "sampled":
                ax.plot(batches, [r["floor_us"] for r in rows], ":", color="black", label="floor (logits read once)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows (branches)")
        ax.set_ylabel("us per step (CUDA graph)")
        ax.set_title(f"vocabulary {vocab:,}")
        ax.legend(fontsize=7)
    fig.suptitle(f"drawing a step's tokens, {result['device']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--modes", nargs="+", default=["sampled", "greedy", "top_p"],
                        choices=["sampled", "greedy", "top_p"])
    parser.add_argument("--hbm-tbps", type=float, default=3.35)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None, metavar="JSON", help="only draw the plot of an earlier run's JSON")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    rows_out = []
    for vocab in args.vocabs:
        for batch in args.batches:
            g = torch.Generator(device="cuda").manual_seed(batch)
            logits0 = torch.randn(batch, vocab, device="cuda", generator=g) * 3
            keys = torch.randint(0, 2 ** 32, (batch,), device="cuda", generator=g)
            steps = torch.randint(0, 1000, (batch,), device="cuda", generator=g)
            words = -(-vocab // 32)
            mask = torch.randint(-2 ** 31, 2 ** 31, (batch, words), device="cuda", generator=g, dtype=torch.int64
                                 ).to(torch.int32)
            for mode in args.modes:
                temperature = torch.full((batch,), 0.0 if mode == "greedy" else 1.0, device="cuda")
                ops = functools.partial(torch_ops, filtered=mode == "top_p")
                one_pass = kernel_filtered if mode == "top_p" else kernel
                source = peaked_logits(batch, vocab, g) if mode == "top_p" else logits0
                for masked in (False, True):
                    bitmask = mask if masked else None
                    logits = source.clone()
                    want = ops(logits.clone(), temperature, keys, steps, bitmask, mode == "greedy")
                    got = one_pass(logits, temperature, keys, steps, bitmask, mode == "greedy")
                    same = bool(torch.equal(want[0], got[0]))
                    t_torch = graphed_us(lambda: ops(logits, temperature, keys, steps, bitmask, mode == "greedy"))
                    t_kernel = graphed_us(lambda: one_pass(source, temperature, keys, steps, bitmask, mode == "greedy"))
                    floor = batch * vocab * 4 / (args.hbm_tbps * 1e12) * 1e6
                    row = {"vocab": vocab, "batch": batch, "mode": mode, "bitmask": masked, "torch_us": t_torch,
                           "kernel_us": t_kernel, "speedup": t_torch / t_kernel, "floor_us": floor,
                           "kernel_x_floor": t_kernel / floor, "same_tokens": same,
                           "max_logprob_diff": float((want[1] - got[1]).abs().max())}
                    rows_out.append(row)
                    print(row, flush=True)
    result = {"benchmark": "sampling", "device": torch.cuda.get_device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                           "python": platform.python_version()},
              "method": "each way captured in a CUDA graph, median of 5 x 50 replays; floor = fp32 logits read once "
                        f"at {args.hbm_tbps} TB/s", "rows": rows_out}
    out = Path(args.out or Path(__file__).parent / "results" / "sampling.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print("| vocab | batch | mode | bitmask | torch us | kernel us | speed-up | x floor | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['vocab']} | {r['batch']} | {r['mode']} | {r['bitmask']} | {r['torch_us']:.1f} | {r['kernel_us']:.1f} | "
              f"{r['speedup']:.1f}x | {r['kernel_x_floor']:.2f} | {r['same_tokens']} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
