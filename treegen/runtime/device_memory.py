"""How much device memory the KV cache may take: the device's free bytes as growth sees them (cached blocks
the allocator can give back included), the margin kept for activations, and how far a pool grows on a
device. Read by the KV store when a pool grows and by the run's admission (its KV budget)."""

from __future__ import annotations

import os

import torch


def expandable_segments() -> bool:
    """Whether the CUDA caching allocator runs with expandable segments (``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF`` holding ``expandable_segments:True``)."""
    conf = ",".join(os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def device_free(device) -> tuple[int, int]:
    """``(free, total)`` bytes of a CUDA device as KV growth and the budget see it: ``free`` counts the
    allocator's cached blocks that it can give back (whole unused segments), not the free parts of
    segments partly in use ("inactive split" blocks), which only allocations that fit inside them can reuse
    — never a pool. (Seen on an H100: pools grown and dropped while activations were carved from the freed
    segments left 14.4 GiB of such blocks; counted as free, a pool grew past what the device could give.)"""
    free, total = torch.cuda.mem_get_info(device)
    return free + releasable_cache(device), total


def releasable_cache(device) -> int:
    """Bytes the CUDA caching allocator holds unused and could give back to the device. (The allocator's
    nested statistics, not ``memory_stats``, which flattens and sorts all of them: the budget asks at every
    admission.)"""
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if unused <= 0:
        return 0
    split = torch.cuda.memory_stats_as_nested_dict(device).get("inactive_split_bytes", {}).get("all", {})
    return max(0, unused - split.get("current", 0))


def activation_margin(device_total: int) -> int:
    """Device memory kept for activations, CUDA graphs and the allocator's slack (cached blocks it cannot
    give back): never given to KV."""
    return int(max(0.1 * device_total, 4 * 2**30))


# memory counted as free that the allocator may still be unable to give (its rounding, pages of the driver's)
UNRELEASABLE_CACHE = 2**30


def growth_on_device(short: int, extra: int, *, per_token: int, copy: int, free: int, device_total: int,
                     where: str = "the device") -> int:
    """Slots a pool grows by on a device with ``free`` bytes (cached blocks included): at least ``short``
    (the slots it must gain; MemoryError naming the bytes when they and ``copy``, the largest old pool held
    while it is copied, do not fit in all but :data:`UNRELEASABLE_CACHE` of it), at most ``extra`` (the geometric growth asked for) — the optional part
    only while the activations' margin stays free. (Seen on an H100, 256 sliced gens of Llama-3-8B: a slice
    taken between admissions grew the pool to the last 128 MiB the device reported, of which ~0.4 GiB were
    cached blocks the allocator could not give back: out of memory.)"""
    need = short * per_token + copy
    if need > free - UNRELEASABLE_CACHE:
        raise MemoryError(f"the KV cache needs {need / 2**30:.2f} GiB more for {short} token slots "
                          f"({per_token} bytes each{', plus a copy of the largest pool it grows' if copy else ''}), "
                          f"{free / 2**30:.2f} GiB is free on {where}, less {UNRELEASABLE_CACHE / 2**30:.0f} GiB kept "
                          f"for cached blocks the allocator may not give back")
    optional = (free - copy - activation_margin(device_total)) // per_token
    return max(short, min(extra, optional))
