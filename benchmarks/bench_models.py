"""The paths that run a model, end to end on one GPU: N completions of one shared prompt.

Rows, random weights of a real model shape, bf16, greedy, EOS ignored so every sequence makes exactly
`new` tokens (speed does not depend on the weights):

* fast        — treegen's own forward (``LlamaFamilyModel``; families of ``treegen/runtime/families.py``);
* generic     — the model's own transformers modules with tree attention plugged in (``GenericModel``),
                CUDA graphs where its modules can be captured; for a mixture-of-experts shape its experts
                run as grouped matmuls (transformers' ``experts_implementation="grouped_mm"``);
* generic_eager_experts — MoE only: the generic path with transformers' eager experts (a loop over the
                experts hit, which syncs with the host: no CUDA graphs);
* hf_generate — Hugging Face ``generate`` with the prompt repeated per sequence (what users run today);
* hf_loop     — the same HF model in a bare forward/argmax loop (no ``generate`` host work).

Decode throughput = batch * (new - 1) / (time(new tokens) - time(1 token)) (bench_end_to_end.py's
method); rows carry ``model``, ``path``, ``batch``, ``tok_s`` and ``ratio_to_hf`` / ``ratio_to_fast``.
Writes ``benchmarks/results/models_<shape>.json`` (after every row: a run cut short keeps what it measured).

    python benchmarks/bench_models.py --shape llama3-8b --batch 64 --prefix 2048 --new 128
    python benchmarks/bench_models.py --shape qwen3-30b-a3b --layers 24 --batch 64 --prefix 2048 --new 128
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import platform
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
import transformers
import triton

from bench_end_to_end import SHAPES as DENSE_SHAPES  # benchmarks/bench_end_to_end.py
from bench_end_to_end import measure_hf, timed_run
from treegen.runtime.engine import Engine
from treegen.runtime.generic import GenericModel
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel

SHAPES = {  # name -> (config class, its arguments)
    **{name: (shape.get("config_class", "LlamaConfig"), {k: v for k, v in shape.items() if k != "config_class"})
       for name, shape in DENSE_SHAPES.items()},
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=32768)),
    "mixtral-8x7b": ("MixtralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        rope_theta=1000000.0, max_position_embeddings=32768)),
}


def make_config(shape: str, layers: int | None):
    cls_name, kw = SHAPES[shape]
    kw = dict(kw, **({"num_hidden_layers": layers} if layers else {}))
    return getattr(transformers, cls_name)(**kw)


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def measure_engine(model, path: str, batch: int, prefix: int, new: int) -> dict:
    engine = Engine(model, IdTokenizer())
    prompt = torch.randint(0, model.vocab_size, (prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    timed_run(engine, batch=batch, prompt=prompt, new=8, flat=False)  # warm-up: compile kernels
    t1, _ = timed_run(engine, batch=batch, prompt=prompt, new=1, flat=False)
    tn, waits = timed_run(engine, batch=batch, prompt=prompt, new=new, flat=False)
    return {"path": path, "batch": batch, "prefix": prefix, "new": new, "total_s": tn, "prefill_s": t1,
            "tok_s": batch * (new - 1) / (tn - t1), "cuda_graphs": engine.cuda_graphs,
            "graphs_off_reason": engine.graphs_off_reason, "memory_waits": waits, "engine": repr(engine)}


def generic_model(config, experts: str | None) -> GenericModel:
    """The HF model of ``config`` with HF's own random init, on the GPU, behind the generic path."""
    options = {"experts_implementation": experts} if experts else {}
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16, **options)
    return GenericModel(hf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape has (memory)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--paths", nargs="+", default=None,
                        help="default: hf_generate fast generic (dense), hf_generate generic generic_eager_experts (MoE)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    config = make_config(args.shape, args.layers)
    moe = SHAPES[args.shape][0] != "LlamaConfig"
    paths = args.paths or (["hf_generate", "generic", "generic_eager_experts"] if moe else ["hf_generate", "fast", "generic"])
    model_name = args.shape + (f" ({args.layers} layers)" if args.layers else "")
    rows: list[dict] = []
    for path in paths:  # one model on the GPU at a time
        try:
            if path == "hf_generate":  # measure_hf times a bare forward/argmax loop too: kept as hf_loop
                for hf_row in measure_hf(copy.deepcopy(config), args.batch, args.prefix, args.new):
                    row = {"path": "hf_generate" if hf_row["mode"] == "hf" else hf_row["mode"],
                           **{k: v for k, v in hf_row.items() if k not in ("mode", "decode_tok_s")},
                           "tok_s": hf_row["decode_tok_s"]}
                    rows.append({"model": model_name, **row})
                    print(rows[-1], flush=True)
                free_memory()
                write_json(args, config, add_ratios(rows))
                continue
            else:
                if path == "fast":
                    model = LlamaFamilyModel.random(config, dtype=torch.bfloat16, device="cuda")
                elif path == "generic":
                    model = generic_model(config, "grouped_mm" if moe else None)
                elif path == "generic_eager_experts":
                    model = generic_model(config, "eager")
                else:
                    raise SystemExit(f"unknown path {path!r}")
                row = measure_engine(model, path, args.batch, args.prefix, args.new)
                del model
        except (MemoryError, torch.cuda.OutOfMemoryError) as e:
            row = {"path": path, "batch": args.batch, "prefix": args.prefix, "new": args.new,
                   "skipped": f"out of memory: {str(e)[:200]}"}
        free_memory()
        rows.append({"model": model_name, **row})
        print(rows[-1], flush=True)
        write_json(args, config, add_ratios(rows))
    print(f"\n## {model_name}, bf16, batch {args.batch}, {args.prefix}-token shared prompt, {args.new} new tokens\n")
    print("| path | decode tok/s | total s | CUDA graphs | / hf_generate | / fast |")  # noqa: E501
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "tok_s" in r:
            print(f"| {r['path']} | {r['tok_s']:,.0f} | {r['total_s']:.2f} | {r.get('cuda_graphs', '-')} | "
                  f"{r.get('ratio_to_hf', float('nan')):.2f} | {r.get('ratio_to_fast', float('nan')):.2f} |")
        else:
            print(f"| {r['path']} | {r['skipped']} | | | | |")
    print(f"wrote {write_json(args, config, rows)}")


def add_ratios(rows: list[dict]) -> list[dict]:
    by = {r["path"]: r for r in rows if "tok_s" in r}
    for r in rows:
        for base, key in (("hf_generate", "ratio_to_hf"), ("fast", "ratio_to_fast")):
            if "tok_s" in r and base in by:
                r[key] = r["tok_s"] / by[base]["tok_s"]
    return rows


def write_json(args, config, rows: list[dict]) -> Path:
    result = {"benchmark": "models", "shape": args.shape, "layers": config.num_hidden_layers,
              "config": {k: v for k, v in SHAPES[args.shape][1].items()}, "dtype": "bfloat16",
              "device": torch.cuda.get_device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "transformers": transformers.__version__, "cuda": torch.version.cuda,
                           "python": platform.python_version()},
              "method": "decode tok/s = batch*(new-1)/(t(new)-t(1)); greedy, EOS ignored; one warm-up run per row",
              "rows": rows}
    out = Path(args.out or Path(__file__).parent / "results" / f"models_{args.shape}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
