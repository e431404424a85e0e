"""Lossless KV offload and recompute: the policy (plain data) and the measured rates it decides by.

When admission is blocked by KV memory, the :class:`~treegen.runtime.scheduler.Scheduler` evicts the
KV of *idle* nodes — nodes no admitted or decoding job reads (a branch that finished a gen and will
continue later, the nodes of a subtree whose jobs wait) — least recently used first, and those no
waiting job reads before those that one does. An evicted node either

* **moves to the host** (a span of the engine's :class:`~treegen.runtime.host_arena.HostArena`, pinned
  memory on CUDA) and is copied back when a job that reads it is
  admitted (the KV store's :meth:`~treegen.runtime.kv_store.KVStore.offload` / ``restore``), or
* **is dropped**, and its tokens are prefilled again when a job reads it (recompute) —

ALISA's three phases (``shared/papers/alisa.txt``, Algorithm 2): GPU only while everything fits, GPU +
CPU when it does not, recompute where recomputing is cheaper than the transfer or the host's share
is used up. Which one is chosen per node from **measured** rates (:func:`measure_rates`: host↔device
copy bandwidth and the model's prefill tokens/s, measured once per engine), not constants.

Either way the KV a later step reads is the KV the node had: offload never changes results.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

OFFLOAD_MODES = ("auto", "host", "recompute", "off")
# the default cap on KV kept on the host: this fraction of the machine's physical memory
HOST_FRACTION = 0.25


@dataclass(frozen=True)
class OffloadRates:
    """Measured on this machine: bytes/s device→host and host→device, and prefill tokens/s."""

    to_host: float
    to_device: float
    prefill_tokens: float

    def __post_init__(self) -> None:
        for name in ("to_host", "to_device", "prefill_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"OffloadRates.{name} must be positive, got {getattr(self, name)!r}")

    def transfer_seconds(self, nbytes: int) -> float:
        """Moving ``nbytes`` of KV to the host and back."""
        return nbytes / self.to_host + nbytes / self.to_device

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens


@dataclass(frozen=True)
class OffloadPolicy:
    """What the scheduler may do with idle KV when admission is blocked by memory.

    ``mode``: ``"auto"`` (host or recompute per node, whichever the measured ``rates`` say is cheaper;
    recompute once ``host_bytes`` is used up), ``"host"`` (always to the host; a job that cannot fit
    without more than ``host_bytes`` there is refused, naming the sizes), ``"recompute"`` (always drop
    and prefill again), ``"off"`` (idle KV stays: work waits, or is refused when it never fits).
    ``rates``: called (once per eviction) in ``"auto"`` mode only."""

    mode: str = "off"
    host_bytes: int = 0
    rates: Callable[[], OffloadRates] | None = None

    def __post_init__(self) -> None:
        if self.mode not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.mode!r}")
        if not isinstance(self.host_bytes, int) or self.host_bytes < 0:
            raise ValueError(f"offload_bytes must be an integer >= 0, got {self.host_bytes!r}")
        if self.mode == "auto" and self.rates is None:
            raise ValueError("offload='auto' needs measured rates")

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def to_host(self, tokens: int, nbytes: int, host_free: int, rates: OffloadRates | None,
                recomputable: bool = True) -> bool | None:
        """Move an idle node of ``tokens`` computed tokens (``nbytes``) to the host (True), drop it
        (False), or neither (None: ``"host"`` mode with no room left on the host, or a node that
        cannot be recomputed — ``recomputable`` False: sparse window attention compacted it, and a
        prefill would make its dense KV — with no room on the host or in ``"recompute"`` mode)."""
        fits = nbytes <= host_free
        if not recomputable and tokens:
            return True if fits and self.mode != "recompute" else None
        if self.mode == "recompute" or tokens == 0:
            return False
        if self.mode == "host":
            return True if fits else None
        return fits and rates.transfer_seconds(nbytes) <= rates.recompute_seconds(tokens)


def default_host_bytes() -> int:
    """``HOST_FRACTION`` of the machine's physical memory (0 where it cannot be read)."""
    try:
        return int(HOST_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def measure_rates(engine, *, copy_bytes: int | None = None, prefill_tokens: int | None = None) -> OffloadRates:
    """Measure host↔device copy bandwidth (pinned host memory on CUDA) and the model's prefill
    tokens/s (a throwaway run prefilling one node of ``prefill_tokens`` tokens, after a warm-up);
    best of a few trials each. Defaults: 64 MiB and 2,048 tokens on CUDA, 8 MiB and 256 on the CPU."""
    device = engine.model.device
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (64 if cuda else 8) * 2**20
    prefill_tokens = prefill_tokens or (2048 if cuda else 256)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    dev = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=cuda) if cuda else torch.empty_like(dev)
    rates = {}
    for name, dst, src in (("to_host", host, dev), ("to_device", dev, host)):
        best = float("inf")
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=cuda)
            sync()
            best = min(best, time.perf_counter() - t0)
        rates[name] = copy_bytes / max(best, 1e-9)
    del dev, host
    n = max(16, min(prefill_tokens, engine.max_prefill_tokens, engine.model.max_context - 1))
    ids = torch.randint(1, engine.model.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    best = float("inf")
    for trial in range(3):
        run = engine.start()
        root = run.tree.add_node(None, ids)
        sync()
        t0 = time.perf_counter()
        run._forward([(root, i) for i in range(n)], [n - 1])  # (the logits of the last row only)
        sync()
        if trial:  # the first one compiles / warms up
            best = min(best, time.perf_counter() - t0)
        del run
    return OffloadRates(rates["to_host"], rates["to_device"], n / max(best, 1e-9))
