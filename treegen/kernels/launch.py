"""Launching a Triton kernel again without Triton's per-call Python: :class:`Launcher`.

A decode step that is not captured in a CUDA graph (mixed steps, short phases, ``cuda_graphs=False``)
launches ~130 Triton kernels from Python, and at small batch the GPU waits for the host. Measured on an
H100 host (Triton 3.6, ``benchmarks/bench_eager_step.py``): ``kernel[grid](...)`` costs 25 µs of host
time a launch, of which the launcher itself (the C function that packs the arguments and calls
``cuLaunchKernel``) is 9 µs and the specialization of the arguments 5 µs; the rest is ``JITFunction.run``'s
bookkeeping (options as a string for the cache key, device and stream lookups, hook and global checks).

:class:`Launcher` keeps, per call site kernel, the compiled kernel of each *specialization* it has seen:
it still runs Triton's own binder (which computes from every argument what a compiled variant depends
on: dtypes, 16-byte alignment, integers equal to 1 or divisible by 16, the constexpr values), keys on
that plus the call's options, and calls the compiled kernel's launcher directly. A key it has not seen
goes through ``kernel[grid](...)``, and the kernel that returns — Triton's own choice for exactly these
arguments — serves that key afterwards; so the fast path never picks a variant Triton would not.
Anything unusual takes Triton's path every time: the interpreter (``TRITON_INTERPRET=1``, the CPU
tests), launch hooks set (profilers), pre-run hooks, a Triton whose internals differ from what this
reads, or ``TREEGEN_FAST_LAUNCH=0``.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None
    JITFunction = ()


def _stream_of_torch(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# the current CUDA stream's handle, as Triton reads it (torch's raw getter: no Stream object made)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _stream_of_torch)


def _hooked(hook) -> bool:
    """A launch hook is set: a function, or a chain of them (``knobs.HookChain``, Triton >= 3.5) not empty."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _knobs():
    try:
        from triton import knobs
    except ImportError:  # (a Triton without knobs: the fast path is off)
        return None
    return knobs


class Launcher:
    """``Launcher(kernel)[grid](*args, **kwargs)`` launches as ``kernel[grid](*args, **kwargs)`` does,
    with the per-call host cost of the compiled kernel's launcher once each specialization has been
    launched through Triton (see the module doc). ``fast_launches``/``triton_launches`` count the two
    paths (tests, benchmarks)."""

    every: list["Launcher"] = []  # every launcher made (set_fast_launch)

    def __init__(self, kernel) -> None:
        Launcher.every.append(self)
        self.kernel = kernel
        self.compiled: dict = {}  # (device, specialization, options) -> compiled kernel
        self.fast_launches = 0
        self.triton_launches = 0
        knobs = _knobs()
        self._knobs = knobs
        self.supported = (isinstance(kernel, JITFunction) and knobs is not None and hasattr(kernel, "device_caches")
                          and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))
        self.enabled = self.supported and os.environ.get("TREEGEN_FAST_LAUNCH", "1") != "0"

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple, args: tuple, kwargs: dict):
        """Launch on ``grid`` (a tuple of 1-3 ints); returns the compiled kernel."""
        if not self.enabled:
            return self._through_triton(grid, args, kwargs)
        knobs, kernel = self._knobs, self.kernel
        runtime = knobs.runtime
        if _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook) or kernel.pre_run_hooks:
            return self._through_triton(grid, args, kwargs)
        device = torch.cuda.current_device()
        # Triton's binder: the last of the device's caches (made on first use, as Triton's own launch does)
        bound, specialization, _ = kernel.device_caches[device][-1](*args, **kwargs)
        try:
            key = (device, tuple(specialization), tuple(kwargs.items()), runtime.debug,
                   knobs.compilation.instrumentation_mode)
            compiled = self.compiled.get(key)
        except TypeError:  # an unhashable specialization: this Triton is not what this reads
            self.enabled = False
            return self._through_triton(grid, args, kwargs)
        if compiled is None:
            compiled = self._through_triton(grid, args, kwargs)
            if hasattr(compiled, "result"):  # (an asynchronous compile's future)
                compiled = compiled.result()
            compiled._init_handles()
            self.compiled[key] = compiled
            return compiled
        self.fast_launches += 1
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     _current_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *bound.values())
        return compiled

    def _through_triton(self, grid, args, kwargs):
        self.triton_launches += 1
        return self.kernel[grid](*args, **kwargs)

    def __repr__(self) -> str:
        name = getattr(self.kernel, "__name__", None) or getattr(getattr(self.kernel, "fn", None), "__name__", "?")
        return (f"Launcher({name}, {'fast' if self.enabled else 'through Triton'}, {len(self.compiled)} variants, "
                f"{self.fast_launches} fast / {self.triton_launches} Triton launches)")


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for the host side of a launch: the smallest power of two at least ``n`` (0 for
    ``n`` <= 0, as Triton's). Triton's is a ``constexpr_function`` since 3.5, whose call wrapper costs ~5 µs of
    host time; a forward pass asks for a handful per layer (block sizes of the attention, RoPE and norm kernels)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def set_fast_launch(on: bool) -> None:
    """Turn the fast path of every launcher on or off (where supported); ``TREEGEN_FAST_LAUNCH=0`` in the
    environment starts them off. Benchmarks compare the two in one process."""
    if not isinstance(on, bool):
        raise TypeError(f"set_fast_launch takes True or False, got {on!r}")
    for launcher in Launcher.every:
        launcher.enabled = on and launcher.supported


__all__ = ["Launcher", "next_power_of_2", "set_fast_launch"]
