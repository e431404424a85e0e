"""Compiles Triton kernels for Hopper (sm_90) without a GPU, every variant listed: run by
``tests/test_kernel_compile.py`` in a process of its own, without ``TRITON_INTERPRET`` (kernels made under the
interpreter are not compilable functions). Prints one line per variant, ``ok`` or ``FAIL`` with the error."""

from __future__ import annotations

import itertools
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from treegen.kernels import filter_floor, sampling  # noqa: E402

F32, I32, I64 = "*fp32", "*i32", "*i64"


def variants():
    """(kernel, its arguments' types in order, the constexpr names with the values each takes)."""
    yield filter_floor._stats_kernel, dict(
        L=F32, stride_l="i32", TEMP=F32, MASK=I32, stride_m="i32", V="i32", WINNER=F32, S_MAX=F32, S_SUM=F32,
        S_ABOVE=F32, S_KMIN=I32, S_KMAX=I32, S_CABOVE=I32, parts="i32"), dict(
        CHUNK=[8192], HAS_MASK=[False, True], HAS_WINNER=[False, True], BLOCK=[filter_floor.BLOCK])
    yield filter_floor._search_kernel, dict(
        L="*bf16", stride_l="i32", TEMP=F32, MASK=I32, stride_m="i32", TOP_P=F32, TOP_K=I64, V="i32", rows="i32",
        parts="i32", WINNER=F32, S_MAX=F32, S_SUM=F32, S_ABOVE=F32, S_KMIN=I32, S_KMAX=I32, S_CABOVE=I32, BIG=F32,
        Z=F32, LO=I64, HI=I64, C_MASS=F32, C_COUNT=I32, THR=I64, P_MASS=F32, P_COUNT=I32, FLOOR=F32, cur="i32"), dict(
        FIRST=[False, True], FINAL=[False, True], CHUNK=[8192], HAS_MASK=[False, True], HAS_WINNER=[False, True],
        WAYS=[filter_floor.WAYS], BLOCK=[filter_floor.BLOCK], BLOCK_P=[16], MARGIN=[filter_floor.MARGIN_NATS])
    yield sampling._gumbel_partial_kernel, dict(
        L="*bf16", stride_l="i32", TEMP=F32, KEYS=I64, STEPS=I64, MASK=I32, stride_m="i32", FLOOR=F32, V="i32",
        start="i32", CHUNK="i32", P_SCORE=F32, P_TOKEN=I64, P_LOGIT=F32, P_MAX=F32, P_SUM=F32, parts="i32"), dict(
        GREEDY=[False, True], HAS_MASK=[False, True], HAS_FLOOR=[False, True], REDO=[False, True], PRECISE=[True],
        BLOCK=[sampling.BLOCK])
    yield sampling._gumbel_combine_kernel, dict(
        P_SCORE=F32, P_TOKEN=I64, P_LOGIT=F32, P_MAX=F32, P_SUM=F32, parts="i32", TOKEN=I64, SCORE=F32, LOGIT=F32,
        LSE=F32, FLOOR=F32), dict(REDO=[False, True], PRECISE=[True], BLOCK_P=[16])


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for kernel, types, constexprs in variants():
        names = list(types) + list(constexprs)
        for values in itertools.product(*constexprs.values()):
            chosen = dict(zip(constexprs, values))
            signature = dict(types) | {name: "constexpr" for name in constexprs}
            source = triton.compiler.ASTSource(fn=kernel, signature=signature,
                                               constexprs={(names.index(k),): v for k, v in chosen.items()})
            try:
                triton.compile(source, target=target)
                print(f"ok {kernel.__name__} {chosen}")
            except Exception as e:  # noqa: BLE001 - every variant reported
                failed += 1
                print(f"FAIL {kernel.__name__} {chosen}: {type(e).__name__}: {str(e)[-2000:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
