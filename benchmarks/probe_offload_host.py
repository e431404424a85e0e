"""Host time of one KV offload on this GPU host (diagnostic): pinned allocation and the copies' issue.

``KVStore.offload`` allocates pinned host tensors for a node's keys and values and issues one copy per layer
and pool. Llama-3-8B's tree-of-thought at 1,024 branches on an H100 (``bench_dynamic.py --shape llama3-8b
--workloads tot --branches 1024``) spent 27 ms a decode step in scheduling, which the CPU replay of the same
shortage (``dynamic_schedule_cpu.py --kv-budget-mb 105``: ~3,000 nodes offloaded, ~1,000 restored) puts
at well under 1 ms of the scheduler's own work: the rest is the offloads' host work on the GPU machine.
This measures its parts per node, Llama-3-8B's KV shape (32 layers, 8 KV heads x 128, bf16), nodes of
130 and 520 tokens: pinning fresh host memory (``alloc_cold_ms``), the same after freeing it
(``alloc_cached_ms``: PyTorch's caching host allocator), and issuing the 64 copies (``issue_copies_ms``).

    python benchmarks/probe_offload_host.py
"""

from __future__ import annotations

import json
import time

import torch

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128


def per_node(k: torch.Tensor, v: torch.Tensor, tokens: int, nodes: int) -> dict:
    slots = k.shape[1]
    t_alloc = t_copy = 0.0
    kept = []
    for i in range(nodes):
        t0 = time.perf_counter()
        hk = torch.empty((LAYERS, tokens, KV_HEADS, HEAD_DIM), dtype=k.dtype, pin_memory=True)
        hv = torch.empty_like(hk, pin_memory=True)
        t1 = time.perf_counter()
        s = (i * tokens) % (slots - tokens)
        for layer in range(LAYERS):
            hk[layer].copy_(k[layer, s : s + tokens], non_blocking=True)
            hv[layer].copy_(v[layer, s : s + tokens], non_blocking=True)
        t_copy += time.perf_counter() - t1
        t_alloc += t1 - t0
        kept.append((hk, hv))
    torch.cuda.synchronize()
    kept.clear()
    t_cached = 0.0
    for _ in range(nodes):
        t0 = time.perf_counter()
        kept.append((torch.empty((LAYERS, tokens, KV_HEADS, HEAD_DIM), dtype=k.dtype, pin_memory=True),
                     torch.empty((LAYERS, tokens, KV_HEADS, HEAD_DIM), dtype=k.dtype, pin_memory=True)))
        t_cached += time.perf_counter() - t0
    kept.clear()
    return {"tokens": tokens, "node_mib": round(2 * LAYERS * tokens * KV_HEADS * HEAD_DIM * k.element_size() / 2**20, 1),
            "alloc_cold_ms": round(1e3 * t_alloc / nodes, 3), "issue_copies_ms": round(1e3 * t_copy / nodes, 3),
            "alloc_cached_ms": round(1e3 * t_cached / nodes, 3)}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("probe_offload_host.py measures a GPU host: no CUDA device here")
    k = torch.empty((LAYERS, 400_000, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
    v = torch.empty_like(k)
    rows = [per_node(k, v, tokens, nodes=60) for tokens in (130, 520)]
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
