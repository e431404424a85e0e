"""Where a tensor-parallel decode step's time goes (diagnostic for bench_multi_gpu.py; 2 GPUs):

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/profile_multi_gpu.py --out OUT.json

Per batch, the decode step time (ms) of the Llama-3-8B shape (random bf16 weights, prefix 2048, 128
new tokens, CUDA graphs) at one GPU and at tp=2, each with tree attention and attention-free
(``none``); the model's forward alone (no engine, no attention, captured as one CUDA graph) at tp=1
and tp=2; and 64 all-reduces of [batch, 4096] bf16 (the two per layer of a step) captured as one graph, and 64 of
the all-reduce + residual add + RMSNorm, two-shot then the norm kernel against the fused kernel.
Also the LM head and the sampler alone (``head_pick_*``: ``[batch, 4096] x [4096, 128256]`` and
:func:`~treegen.runtime.sampler.pick`, one CUDA graph), greedy / temperature / top-p, with the head
whole on each GPU against split by vocabulary (its ``[batch, 4]`` all-gather, or for top-p the logits').
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # symmetric memory: peer loads only, never multicast

import torch
import torch.distributed as dist

from bench_multi_gpu import config_of, decode_time  # benchmarks/bench_multi_gpu.py
from treegen.runtime.cuda_graph import capture
from treegen.runtime.distributed import init_parallel
from treegen.runtime.engine import Engine
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.peer_all_reduce import PeerAllReduce
from treegen.runtime.sampler import pick
from treegen.runtime.vocab_split import VocabSplit


def graph_ms(fn, reps: int = 20) -> float:
    """Mean time (ms) of one replay of ``fn`` captured as a CUDA graph (as the engine captures steps)."""
    g = capture(fn)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def forward_ms(model: LlamaFamilyModel, batch: int) -> float:
    """The model's forward over ``batch`` tokens with attention replaced by the identity on q."""
    ids = torch.randint(0, model.vocab_size, (batch,), device=model.device)
    pos = torch.full((batch,), 2100, device=model.device)
    return graph_ms(lambda: model.forward(ids, pos, lambda i, q, k, v: q))


def head_pick_ms(tp2, hidden: int, vocab: int, batches: list[int]) -> dict:
    """Per batch, ms of the LM head's product and the sampler's pick, captured as one graph: the head
    whole on this GPU, and split by vocabulary over the two (this GPU's rows and the collectives)."""
    gen = torch.Generator(device=tp2.device).manual_seed(0)
    whole = torch.randn(vocab, hidden, generator=gen, device=tp2.device, dtype=torch.bfloat16) * 0.02
    split = VocabSplit(dataclasses.replace(tp2.tensor, vocab_parallel=True), vocab)
    mine = whole[split.start:split.stop]
    res = {}
    for b in batches:
        h = torch.randn(b, hidden, generator=gen, device=tp2.device, dtype=torch.bfloat16)
        keys = torch.arange(b, device=tp2.device)
        steps = torch.zeros(b, dtype=torch.int64, device=tp2.device)
        row = {}
        for kind, temp, top_p in (("greedy", 0.0, 1.0), ("temperature", 0.8, 1.0), ("top_p", 0.8, 0.95)):
            args = dict(temperature=torch.full((b,), temp, device=tp2.device),
                        top_p=torch.full((b,), top_p, device=tp2.device),
                        top_k=torch.zeros(b, dtype=torch.int64, device=tp2.device), keys=keys, steps=steps,
                        all_greedy=temp == 0, filter_needed=top_p < 1)
            for head, w, s in (("whole", whole, None), ("split", mine, split)):
                row[f"head_pick_{head}_{kind}_ms"] = graph_ms(
                    lambda: pick(torch.nn.functional.linear(h, w).float(), split=s, **args))
        res[b] = row
    return res


def symmetric_memory_all_reduces(tp2, hidden: int, batches: list[int]) -> dict:
    """64 all-reduces of [batch, hidden] bf16 through PyTorch symmetric memory (peer-to-peer loads over
    NVLink, no multicast): one-shot and two-shot, each with its copy into the symmetric buffer; and
    whether they sum exactly as NCCL does."""
    import torch.distributed._symmetric_memory as symm_mem

    group = tp2.tensor.group if tp2.tensor.group is not None else dist.group.WORLD
    name = group.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(name)
    buf = symm_mem.empty(max(batches) * hidden, dtype=torch.bfloat16, device=tp2.device)
    handle = symm_mem.rendezvous(buf, name)
    out = {"symm_multicast_ptr_zero": int(handle.multicast_ptr) == 0}
    res = {}
    for b in batches:
        x = torch.randn(b, hidden, dtype=torch.bfloat16, device=tp2.device) * (1 + tp2.rank)
        want = x.clone()
        dist.all_reduce(want, group=group)
        y = torch.empty_like(x)
        view = buf[: b * hidden].view(b, hidden)

        def one_shot():
            view.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", name, y)

        def two_shot():
            view.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", name)
            y.copy_(view)

        row = dict(out)
        for label, fn in (("one_shot", one_shot), ("two_shot", two_shot)):
            fn()
            torch.cuda.synchronize()
            row[f"symm_{label}_max_err"] = (y.float() - want.float()).abs().max().item()
            row[f"symm_{label}_64_ms"] = graph_ms(lambda: [fn() for _ in range(64)])
        res[b] = row
    return res


def fused_add_norm_ms(tp2, hidden: int, batches: list[int]) -> dict:
    """Per batch, 64 of the layer's sum + residual add + RMSNorm of [batch, hidden] bf16 over the group's peer
    memory, captured as one graph: PyTorch's two-shot all-reduce of a product already in the peer buffer and
    then the add + norm kernel (``two_shot_add_norm_64_ms``: the path before the fused kernel), against the
    fused kernel (``fused_add_norm_64_ms``); and whether the fused one gives the same ``h`` bits."""
    from treegen.kernels import peer_add_norm
    from treegen.kernels.fused_ops import add_rms_norm

    peer = tp2.tensor.peer
    # slots as large as the largest batch, whatever FUSED_MAX_BYTES says (a second buffer: every rank makes it; each
    # operation pushes its partial to every peer)
    fused = PeerAllReduce(tp2.tensor.group, tp2.device, nbytes=16,
                          fused_bytes=max(batches) * hidden * 2 * (tp2.tensor.shard.size - 1))
    w = torch.rand(hidden, dtype=torch.bfloat16, device=tp2.device) + 0.5
    res = {}
    for b in batches:
        part = torch.randn(b, hidden, dtype=torch.bfloat16, device=tp2.device) * (1 + tp2.rank)
        h0 = torch.randn(b, hidden, dtype=torch.bfloat16, device=tp2.device)
        h_two, h_fused = h0.clone(), h0.clone()
        view = peer.output((b, hidden), torch.bfloat16)
        view.copy_(part)
        x_two = add_rms_norm(h_two, peer.sum_(view), w, 1e-5)
        x_fused = fused.add_rms_norm_(part, h_fused, w, 1e-5)
        torch.cuda.synchronize()
        row = {"fused_h_equal": bool(torch.equal(h_two, h_fused)),
               "fused_x_max_err": (x_two.float() - x_fused.float()).abs().max().item()}
        h = h0.clone()
        row["two_shot_add_norm_64_ms"] = graph_ms(lambda: [add_rms_norm(h, peer.sum_(view), w, 1e-5)
                                                          for _ in range(64)])
        fused_64 = lambda: [fused.add_rms_norm_(part, h, w, 1e-5) for _ in range(64)]  # noqa: E731
        row["fused_add_norm_64_ms"] = graph_ms(fused_64)
        default = peer_add_norm.TILE_ELEMS
        for tile in (4096, 8192):  # the kernel's tiling capped at one and two rows of 4,096
            peer_add_norm.TILE_ELEMS = tile
            row[f"fused_add_norm_64_ms_tile{tile}"] = graph_ms(fused_64)
        peer_add_norm.TILE_ELEMS = default
        res[b] = row
    return res


def write(path: str, rows: dict, args) -> None:
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%d"), "tp": args.tp, "prefix": args.prefix, "new": args.new,
                   "rows": list(rows.values())}, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--out", required=True)
    p.add_argument("--allreduce-only", action="store_true")
    p.add_argument("--tp", type=int, default=2, help="the group's GPUs (the tp2_* rows are then tp=N's)")
    args = p.parse_args()
    tp2 = init_parallel(tensor_parallel=args.tp, device="cuda", timeout_s=1800)
    leader = tp2.rank == 0
    cfg = config_of("llama3-8b")
    rows = {b: {"batch": b} for b in args.batches}

    def step_ms(engine, batch):
        dt, _ = decode_time(engine, batch, args.prefix, args.new)
        return 1e3 * dt / (args.new - 1)

    for b in args.batches:  # all-reduces alone
        x = torch.randn(b, cfg.hidden_size, dtype=torch.bfloat16, device=tp2.device)
        rows[b]["allreduce_64_ms"] = graph_ms(lambda: [tp2.tensor.all_reduce(x) for _ in range(64)])
    try:
        rows_symm = symmetric_memory_all_reduces(tp2, cfg.hidden_size, args.batches)
        for b in args.batches:
            rows[b].update(rows_symm[b])
    except Exception as e:  # noqa: BLE001 - a diagnostic: record why
        for b in args.batches:
            rows[b]["symm_error"] = f"{type(e).__name__}: {e}"[:500]
    if tp2.tensor.peer is not None:
        fused = fused_add_norm_ms(tp2, cfg.hidden_size, args.batches)
        for b in args.batches:
            rows[b].update(fused[b])
    heads = head_pick_ms(tp2, cfg.hidden_size, cfg.vocab_size, args.batches)
    for b in args.batches:
        rows[b].update(heads[b])
    if leader:
        print(json.dumps(list(rows.values())), flush=True)
        write(args.out, rows, args)
    if args.allreduce_only:
        dist.barrier()
        dist.destroy_process_group()
        return
    if leader:
        model = LlamaFamilyModel.random(cfg, device=tp2.device)
        for b in args.batches:
            rows[b]["tp1_forward_ms"] = forward_ms(model, b)
            for mode in ("none", "tree"):
                rows[b][f"tp1_{mode}_step_ms"] = step_ms(Engine(model, IdTokenizer(), attention=mode), b)
            print(json.dumps(rows[b]), flush=True)
        del model
        torch.cuda.empty_cache()
    dist.barrier()
    model = LlamaFamilyModel.random(cfg, device=tp2.device, tp=tp2.tensor)
    for b in args.batches:
        dist.barrier()
        rows[b]["tp2_forward_ms"] = forward_ms(model, b)
        for mode in ("none", "tree"):
            dist.barrier()
            rows[b][f"tp2_{mode}_step_ms"] = step_ms(Engine(model, IdTokenizer(), attention=mode, parallel=tp2), b)
        if leader:
            print(json.dumps(rows[b]), flush=True)
            write(args.out, rows, args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
