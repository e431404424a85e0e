"""One tree-attention call on a paper-grid decode shape, to run under Nsight Compute (GPU).

A 2,048-token prefix over BATCH leaves of SUFFIX keys, one query each, Llama-3-8B heads (32/8 x 128), bf16
queries over a KV_DTYPE cache (auto: bf16; int8; fp8); the call runs four times (ncu picks one with
``--launch-skip``). ``DUMP=dir`` also writes the leaves' kernel variant's TTGIR, PTX and cubin there (for
``cuobjdump -sass``). What stop 40's notes measured with it (H100):

    ncu --kernel-name regex:_segment_attention --launch-skip 2 --launch-count 1 --section SourceCounters \\
        --section WarpStateStats -o rep python benchmarks/ncu_leaves.py 1024 32 auto
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv   # executed instructions per SASS line

    python benchmarks/ncu_leaves.py BATCH SUFFIX KV_DTYPE [PACK_LEAVES]
"""

import os
import pathlib
import sys

import torch

from bench_leaf_pack import decode_case  # benchmarks/
from treegen.kernels.launch import Launcher
from treegen.kernels.tree_attention import plan_tree_attention, tree_attention


def main() -> None:
    if len(sys.argv) not in (4, 5):
        raise SystemExit(__doc__)
    batch, suffix, kv_dtype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    pack = int(sys.argv[4]) if len(sys.argv) == 5 else None
    head_dim = 128
    tree, q, k, v, scales, _ = decode_case(batch, 2048, suffix, 32, 8, head_dim, kv_dtype)
    plan = plan_tree_attention(**tree, dtype=q.dtype, triton_options={"pack_leaves": pack})
    print("launches (block_m, block_n, warps, stages, programs, pack):",
          [(w.block_m, w.block_n, w.num_warps, w.num_stages, w.work.shape[0], w.pack) for w in plan.triton.launches])
    for _ in range(4):
        tree_attention(q, k, v, plan, head_dim**-0.5, *scales)
    torch.cuda.synchronize()
    out = os.environ.get("DUMP")
    if out:
        for launcher in Launcher.every:
            for key, kernel in launcher.compiled.items():
                if dict(key[2]).get("BLOCK_M") == 16:
                    base = pathlib.Path(out) / f"leaf_{kv_dtype}_{batch}_pack{dict(key[2]).get('PACK', 1)}"
                    base.with_suffix(".ttgir").write_text(kernel.asm["ttgir"])
                    base.with_suffix(".ptx").write_text(kernel.asm["ptx"])
                    base.with_suffix(".cubin").write_bytes(kernel.asm["cubin"])
                    print("wrote", base, "registers", kernel.n_regs, "spills", kernel.n_spills)


if __name__ == "__main__":
    main()
