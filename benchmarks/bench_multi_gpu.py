"""Decode throughput on N GPUs: tensor parallel (tp=N) and data parallel (dp=N) against one GPU.

Run under torchrun, one process per GPU (NVLink multicast off); N is torchrun's world size:

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py

Workload as in bench_end_to_end.py: one shared prompt of ``--prefix`` random tokens, ``batch``
branches of ``--new`` greedy tokens (EOS ignored), random bf16 weights of the real shape (speed does
not depend on the weights), tree attention, CUDA graphs. Decode tok/s = batch*(new-1)/(t(new)-t(1)).

* ``tp=1``: one GPU (rank 0; the others wait);
* ``tp=N``: the model split over all N GPUs (every rank runs the same steps; one all-reduce after o and
  after down in every layer), with the LM head whole on each GPU or split by vocabulary
  (``--vocab-parallel on|off|both``; ``both``, the default, measures the two alternately at every
  batch; each row records ``vocab_parallel``);
* ``dp=N``: each GPU a whole model and 1/N of the branches (the prefix subtree split N ways, as
  ``run_batch`` splits a batch of programs sharing one prefix); the time is the slowest replica's;
* ``dp=N/2 x tp=2`` (4 or more GPUs): replicas of two GPUs each.

Llama-3-8B shape: all three over ``--batches``; Llama-3-70B shape at tp=N over ``--batches-70b``
with its attention-free (``none``) ceiling. JSON: benchmarks/results/multi_gpu_<device>.json (a row
per point: shape, batch, tp, dp, tok_s, speedup_vs_1gpu / ratio_to_none) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
import torch.distributed as dist
import transformers
import triton
from transformers import LlamaConfig

from bench_end_to_end import SHAPES, timed_run  # benchmarks/bench_end_to_end.py
from plotting import pyplot, save, throughput_axes  # benchmarks/plotting.py
from treegen.runtime import peer_all_reduce
from treegen.runtime.distributed import init_parallel
from treegen.runtime.engine import Engine
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel

SHAPES = dict(SHAPES, **{"llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                            num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                            rope_theta=500000.0, max_position_embeddings=32768)})


def config_of(shape: str) -> LlamaConfig:
    return LlamaConfig(**SHAPES[shape], tie_word_embeddings=False)


def decode_time(engine: Engine, batch: int, prefix: int, new: int) -> tuple[float, float]:
    """(t(new) - t(1), t(new)) of ``batch`` branches below one ``prefix``-token prompt."""
    prompt = torch.randint(0, engine.model.vocab_size, (prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    timed_run(engine, batch=batch, prompt=prompt, new=8, flat=False)  # warm-up: compile kernels
    t1, _ = timed_run(engine, batch=batch, prompt=prompt, new=1, flat=False)
    tn, _ = timed_run(engine, batch=batch, prompt=prompt, new=new, flat=False)
    gc.collect()
    return tn - t1, tn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048])
    p.add_argument("--batches-70b", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--shapes", nargs="+", default=["llama3-8b", "llama3-70b"], choices=["llama3-8b", "llama3-70b"])
    p.add_argument("--skip-70b", action="store_true", help="the same as --shapes llama3-8b")
    p.add_argument("--vocab-parallel", choices=["on", "off", "both"], default="both",
                   help="tp=N: the LM head split by vocabulary (on), whole on each GPU (off), or both, alternately")
    p.add_argument("--peer-output", choices=["on", "off", "both"], default="on",
                   help="tp=N on the 8B shape: o and down write into the peer all-reduce's buffer (on), or their "
                        "products are copied in and out (off), or both, alternately (rows: peer_output)")
    p.add_argument("--fused-norm", choices=["on", "off", "both"], default="on",
                   help="tp=N on the 8B shape: o and down's sums, the residual add and the next RMSNorm in one kernel "
                        "over peer memory (on), or the all-reduce and then the norm kernel (off), or both, "
                        "alternately (rows: fused_norm)")
    p.add_argument("--fused-max-mib", type=float, default=None,
                   help="the largest partial (MiB) the fused all-reduce + add + norm kernel takes (default: "
                        "peer_all_reduce.FUSED_MAX_BYTES)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.fused_max_mib is not None:
        peer_all_reduce.FUSED_MAX_BYTES = int(args.fused_max_mib * 2**20)
    args.heads = ways(args.vocab_parallel, first=False)
    args.peer_outputs = ways(args.peer_output)
    args.fused_norms = ways(args.fused_norm)

    gpus = int(os.environ.get("WORLD_SIZE", "2"))
    tpn = init_parallel(tensor_parallel=gpus, device="cuda", timeout_s=1800)  # all GPUs as one replica
    dpn = init_parallel(tensor_parallel=1, data_parallel=gpus, device="cuda", timeout_s=1800)  # a replica each
    # dp x tp=2 (four or more GPUs): replicas of two GPUs each
    hybrid = init_parallel(tensor_parallel=2, data_parallel=gpus // 2, device="cuda", timeout_s=1800) \
        if gpus >= 4 and gpus % 2 == 0 else None
    args.gpus = gpus
    leader = tpn.rank == 0
    out = Path(args.out or Path(__file__).parent / "results" /
               f"multi_gpu_{torch.cuda.get_device_name().split()[-1].lower()}{'' if gpus == 2 else f'_x{gpus}'}.json")
    if args.skip_70b:
        args.shapes = ["llama3-8b"]
    # Rows of shapes this run does not measure are kept from the file (the shapes may run separately).
    rows: list[dict] = ([r for r in json.loads(out.read_text())["rows"] if r["shape"] not in args.shapes]
                        if out.exists() else [])

    def record(row: dict) -> None:
        if leader:
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_json(args, rows, out)

    def new_tokens(batch: int, seconds: float) -> float:
        return batch * (args.new - 1) / seconds

    if "llama3-8b" in args.shapes:
        measure_8b(args, tpn, dpn, record, new_tokens)
        if hybrid is not None:
            measure_8b_hybrid(args, hybrid, record, new_tokens, one_gpu_8b)
    if "llama3-70b" in args.shapes:
        measure_70b(args, tpn, record, new_tokens)
    if leader:
        plot(rows, out.with_suffix(".png"), gpus)
    dist.barrier()
    dist.destroy_process_group()


one_gpu_8b: dict[int, float] = {}  # the 8B shape's one-GPU tok/s by batch (rank 0), for the dp x tp rows


def measure_8b(args, tpn, dpn, record, new_tokens) -> None:
    """Llama-3-8B shape: one GPU, tp=N, dp=N at every batch."""
    leader = tpn.rank == 0
    cfg = config_of("llama3-8b")
    one_gpu = one_gpu_8b
    if leader:
        model = LlamaFamilyModel.random(cfg, device=tpn.device)
        engine = Engine(model, IdTokenizer())
        for batch in args.batches:
            dt, total = decode_time(engine, batch, args.prefix, args.new)
            one_gpu[batch] = new_tokens(batch, dt)
            record({"shape": "llama3-8b", "batch": batch, "tp": 1, "dp": 1, "tok_s": one_gpu[batch],
                    "total_s": total, "speedup_vs_1gpu": 1.0})
        del model, engine
        gc.collect()
        torch.cuda.empty_cache()
    dist.barrier()

    # both heads' models at once (8B at tp=2: ~8.5 GB a GPU each), measured alternately at every batch, so
    # drift over the run falls on both alike
    engines = {(split, direct, fused): Engine(LlamaFamilyModel.random(cfg, device=tpn.device,
                                                                      tp=split_head(tpn, split, direct, fused)),
                                              IdTokenizer(), parallel=tpn)
               for split in args.heads for direct in args.peer_outputs for fused in args.fused_norms}
    for batch in args.batches:
        for (split, direct, fused), engine in (engines.items() if batch % 2 == 0 else reversed(engines.items())):
            dist.barrier()
            dt, total = decode_time(engine, batch, args.prefix, args.new)
            tok_s = new_tokens(batch, dt)
            record({"shape": "llama3-8b", "batch": batch, "tp": args.gpus, "dp": 1, "vocab_parallel": split, "tok_s": tok_s,
                    "total_s": total, "speedup_vs_1gpu": tok_s / one_gpu[batch] if leader else None,
                    "all_reduce": tpn.tensor.all_reduce_path, "peer_output": direct, "fused_norm": fused,
                    # (bytes pushed: a slot's to each of the other GPUs)
                    "fused_max_bytes": 2 * tpn.tensor.peer.slot_elems * (args.gpus - 1)
                    if tpn.tensor.peer is not None else None})
    del engines
    gc.collect()
    torch.cuda.empty_cache()

    model = LlamaFamilyModel.random(cfg, device=dpn.device)
    engine = Engine(model, IdTokenizer(), parallel=dpn)
    for batch in args.batches:
        mine = batch // args.gpus + (1 if dpn.dp_rank < batch % args.gpus else 0)
        dist.barrier()
        dt, total = decode_time(engine, mine, args.prefix, args.new)
        times = dpn.gather((dt, total))  # the batch is done when the slowest replica is
        slowest = max(t for t, _ in times)
        tok_s = new_tokens(batch, slowest)
        row = {"shape": "llama3-8b", "batch": batch, "tp": 1, "dp": args.gpus, "tok_s": tok_s,
               "total_s": max(t for _, t in times), "speedup_vs_1gpu": tok_s / one_gpu[batch] if leader else None,
               # the slowest replica's decode time over the replicas' mean
               "replica_imbalance": slowest / (sum(t for t, _ in times) / len(times))}
        if leader and batch // args.gpus in one_gpu and batch % args.gpus == 0:
            # The most dp=N can give: N GPUs each as fast as one GPU at 1/N of the batch.
            row["ideal_speedup_vs_1gpu"] = args.gpus * one_gpu[batch // args.gpus] / one_gpu[batch]
        record(row)
    del model, engine
    gc.collect()
    torch.cuda.empty_cache()



def measure_8b_hybrid(args, par, record, new_tokens, one_gpu: dict[int, float]) -> None:
    """Llama-3-8B shape at dp x tp=2: each replica two GPUs and 1/dp of the branches; the slowest replica's time."""
    model = LlamaFamilyModel.random(config_of("llama3-8b"), device=par.device, tp=split_head(par, False))
    engine = Engine(model, IdTokenizer(), parallel=par)
    for batch in args.batches:
        mine = batch // par.dp + (1 if par.dp_rank < batch % par.dp else 0)
        dist.barrier()
        dt, total = decode_time(engine, mine, args.prefix, args.new)
        times = par.gather((dt, total))
        slowest = max(t for t, _ in times)
        tok_s = new_tokens(batch, slowest)
        record({"shape": "llama3-8b", "batch": batch, "tp": par.tp, "dp": par.dp, "vocab_parallel": False,
                "tok_s": tok_s, "total_s": max(t for _, t in times),
                "speedup_vs_1gpu": tok_s / one_gpu[batch] if par.rank == 0 else None,
                "replica_imbalance": slowest / (sum(t for t, _ in times) / len(times)),
                "all_reduce": par.tensor.all_reduce_path})
    del model, engine
    gc.collect()
    torch.cuda.empty_cache()


def ways(choice: str, first: bool = True) -> list[bool]:
    """An on / off / both option as the settings to measure (both: ``first`` and then the other)."""
    return {"on": [True], "off": [False], "both": [first, not first]}[choice]


def split_head(tpn, split: bool, peer_output: bool = True, fused_norm: bool = True):
    """tpn's tensor-parallel group, the LM head split by vocabulary or whole; o and down writing into the
    peer buffer (``peer_output``) or copied in and out of it; their sums taken in the fused add + norm kernel
    (``fused_norm``) or by the all-reduce and then the norm."""
    return dataclasses.replace(tpn.tensor, vocab_parallel=split, peer_output=peer_output, fused_norm=fused_norm)


def measure_70b(args, tpn, record, new_tokens) -> None:
    """Llama-3-70B shape at tp=N, with its attention-free ceiling at every batch; one head after the
    other (two 70B models do not fit two GPUs)."""
    for split in args.heads:
        model = LlamaFamilyModel.random(config_of("llama3-70b"), device=tpn.device, tp=split_head(tpn, split))
        for batch in args.batches_70b:
            speeds = {}
            for mode in ("none", "tree"):
                engine = Engine(model, IdTokenizer(), attention=mode, parallel=tpn)
                dist.barrier()
                dt, total = decode_time(engine, batch, args.prefix, args.new)
                speeds[mode] = new_tokens(batch, dt)
                del engine
            record({"shape": "llama3-70b", "batch": batch, "tp": args.gpus, "dp": 1, "vocab_parallel": split,
                    "tok_s": speeds["tree"], "none_tok_s": speeds["none"], "ratio_to_none": speeds["tree"] / speeds["none"],
                    "all_reduce": tpn.tensor.all_reduce_path})
        del model
        gc.collect()
        torch.cuda.empty_cache()


def write_json(args, rows: list[dict], out: Path) -> None:
    """The results so far (written after every point: a run cut short keeps what it measured)."""
    result = {"benchmark": "multi_gpu", "devices": [torch.cuda.get_device_name(i) for i in range(args.gpus)],
              "gpus": args.gpus, "dtype": "bfloat16", "prefix": args.prefix, "new": args.new,
              "shapes": {s: SHAPES[s] for s in ("llama3-8b", "llama3-70b")},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "transformers": transformers.__version__, "cuda": torch.version.cuda,
                           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "python": platform.python_version()},
              "method": "decode tok/s = batch*(new-1)/(t(new)-t(1)); greedy, EOS ignored, tree attention, CUDA graphs; "
                        "one warm-up run per point; dp=N: 1/N of the branches per GPU, the slowest replica's time; "
                        "tp=N rows: vocab_parallel = LM head split by vocabulary (else whole on each GPU), the 8B "
                        "shape's two heads measured alternately at every batch; peer_output = o and down write into "
                        "the peer all-reduce's buffer (False: copied in and out; plotted: True); fused_norm = their sums, "
                        "the residual add and the next RMSNorm in one kernel over peer memory (False: the all-reduce "
                        "and then the norm kernel; plotted: True)",
              "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def plot(rows: list[dict], out: Path, n: int = 2) -> None:
    """Left: 8B shape, tok/s against batch for tp=1, tp=N, dp=N. Right: 70B shape at tp=N and its ceiling."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    small = [r for r in rows if r["shape"] == "llama3-8b"]
    for tp, dp, split, label in ((1, 1, None, "one GPU"), (n, 1, False, f"tp={n}"),
                                 (n, 1, True, f"tp={n}, head split by vocab"), (1, n, None, f"dp={n}"),
                                 *([(2, n // 2, False, f"dp={n // 2} x tp=2")] if n >= 4 else [])):
        pts = sorted((r["batch"], r["tok_s"]) for r in small
                     if r["tp"] == tp and r["dp"] == dp and r.get("peer_output", True) and r.get("fused_norm", True)
                     and (tp == 1 or bool(r.get("vocab_parallel")) == split))
        if pts:
            axes[0].plot(*zip(*pts), marker="o", label=label)
    axes[0].set_title("Llama-3-8B shape")
    throughput_axes(axes[0], "batch")
    for split in (False, True):
        big = sorted((r for r in rows if r["shape"] == "llama3-70b" and bool(r.get("vocab_parallel")) == split),
                     key=lambda r: r["batch"])
        if big:
            head = ", head split" if split else ""
            axes[1].plot([r["batch"] for r in big], [r["tok_s"] for r in big], marker="o", label=f"tp={n} tree{head}")
            axes[1].plot([r["batch"] for r in big], [r["none_tok_s"] for r in big], marker="x", ls="--",
                         label=f"tp={n} no attention (ceiling){head}")
    axes[1].set_title(f"Llama-3-70B shape, tp={n}")
    throughput_axes(axes[1], "batch")
    fig.suptitle(f"treegen decode on {n} GPUs (prefix 2048, 128 new tokens, bf16)")
    save(fig, out)


if __name__ == "__main__":
    main()
