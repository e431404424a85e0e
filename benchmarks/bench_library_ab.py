"""The cuDNN shared-prefix segment on and off, end to end: does the library kernel pay for a model shape?

For a named shape (random weights, bf16, prefix 2048, 128 new tokens): treegen's `tree` decode tokens/s
with the library segment as the plan chooses it and with it forced off (the Triton kernels attend every
segment), and the attention-free ceiling `none`, in the same process. Writes
`benchmarks/results/library_ab_<shape>_<gpu>.json`.

    python benchmarks/bench_library_ab.py --shape phi-4-mini --batches 256 1024
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import bench_end_to_end as e2e
from bench_attention import result_header
from treegen.kernels import tree_attention as planning
from treegen.runtime.model import LlamaFamilyModel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(e2e.SHAPES), default="phi-4-mini")
    p.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = LlamaFamilyModel.random(e2e.config_of(args.shape), dtype=torch.bfloat16, device="cuda")
    available = planning.library_available
    rows = []
    try:
        for batch in args.batches:
            for library in (True, False):
                planning.library_available = available if library else (lambda device, dtype: False)
                for mode in ("tree", "none") if library else ("tree",):
                    row = e2e.measure_treegen(model, mode, batch, 2048, 128)
                    rows.append({**row, "shape": args.shape, "library": library})
                    print(rows[-1], flush=True)
    finally:
        planning.library_available = available
    result = {**result_header("library_ab", "decode tok/s = batch * 127 / (time(128 tokens) - time(1 token))"),
              "shape": args.shape, "rows": rows}
    gpu = "h200" if "H200" in result["device"] else "h100"
    out = Path(args.out or Path(__file__).parent / "results" / f"library_ab_{args.shape}_{gpu}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
