"""End-to-end throughput on one GPU: N completions of one shared prompt (the Hydragen paper's setup).

Modes, all on treegen's own runtime with random weights of a real model shape (speed does not depend
on the weights), bf16, greedy (or ``--temperature`` / ``--top-p``), EOS ignored so every sequence makes
exactly `new` tokens:

* tree — hierarchical attention over the sharing tree (the prompt stored and read once);
* flat — no sharing: every sequence holds and prefills its own copy of the prompt (FlashAttention /
         vLLM-style baseline; run while its KV fits);
* none — attention skipped (the throughput ceiling; functionally wrong);
* hf   — Hugging Face `generate` with the prompt repeated per sequence (what users run today);
* hf_loop — the same HF model driven by a bare loop (forward with its KV cache, argmax, no `generate`):
         HF's model speed without `generate`'s per-step host work, a stricter baseline.

Decode throughput = batch * (new - 1) / (time(new tokens) - time(1 token)), as in the paper; the total
time (prefill included) is reported too. Prints a table, writes JSON and a PNG under benchmarks/results/.

    python benchmarks/bench_end_to_end.py --shape llama3-8b --batches 32 64 128 256 512 1024 --prefix 2048
    python benchmarks/bench_end_to_end.py --shape llama3-8b --prefix-sweep 1024 2048 4096 8192 16384 --batches 1024
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # many differently sized runs

import torch
import transformers
import triton

from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.sampler import SamplingParams
from treegen.runtime.scheduler import SLICE_TOKENS
from plotting import pyplot, save, throughput_axes  # benchmarks/plotting.py

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=32768),
    "codellama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32016, rope_theta=1000000.0, max_position_embeddings=32768),
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, rope_theta=10000.0, max_position_embeddings=32768),
    # other families (issue 16): "config_class" names the transformers config the shape is built with
    "qwen3-8b": dict(config_class="Qwen3Config", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     rope_theta=1000000.0, max_position_embeddings=40960),
    "phi-4-mini": dict(config_class="Phi3Config", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                       num_attention_heads=24, num_key_value_heads=8, vocab_size=200064, tie_word_embeddings=True,
                       max_position_embeddings=131072, original_max_position_embeddings=4096,
                       sliding_window=262144,  # (its config's: longer than any context, so no window)
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                        "short_factor": [1.0 + 0.05 * i for i in range(48)],
                                        "long_factor": [2.0 + 0.5 * i for i in range(48)]}),
    # 5 local (window 1024) : 1 global layers, head_dim 256
    "gemma-3-12b": dict(config_class="Gemma3TextConfig", hidden_size=3840, intermediate_size=15360,
                        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                        query_pre_attn_scalar=256, vocab_size=262208, sliding_window=1024,
                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
                        max_position_embeddings=131072,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 1000000.0}}),
}


def config_of(shape: str):
    """The transformers config of a named shape (a Llama config unless the shape names its class)."""
    import transformers

    kw = dict(SHAPES[shape])
    return getattr(transformers, kw.pop("config_class", "LlamaConfig"))(**kw)


# how the treegen modes sample (--temperature, --top-p)
SAMPLING = {"temperature": 0.0, "top_p": 1.0}


def timed_run(engine: Engine, *, batch: int, prompt: list[int], new: int, flat: bool) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    run = engine.start()
    tree = run.tree
    if flat:
        leaves = [tree.add_node(None, prompt) for _ in range(batch)]
    else:
        root = tree.add_node(None, prompt)
        leaves = [tree.add_node(root) for _ in range(batch)]
    params = SamplingParams(max_tokens=new, ignore_eos=True, **SAMPLING)
    results, _ = run.execute([GenRequest(leaf, params, key=i, final=True) for i, leaf in enumerate(leaves)], [])
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert all(len(r.tokens) == new for r in results)
    waits = run.scheduler.memory_waits  # > 0: not every branch fit in memory at once
    del run, results
    gc.collect()
    return elapsed, waits


def measure_treegen(model, mode: str, batch: int, prefix: int, new: int, kv_dtype: str = "auto",
                    slice_tokens: int | None = None, host_reserve: int = 0) -> dict:
    engine = Engine(model, IdTokenizer(), attention="tree" if mode == "flat" else mode,
                    kv_dtype=None if kv_dtype == "auto" else kv_dtype, slice_tokens=slice_tokens,
                    host_reserve_bytes=host_reserve)
    prompt = torch.randint(0, model.vocab_size, (prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    flat = mode == "flat"
    timed_run(engine, batch=batch, prompt=prompt, new=8, flat=flat)  # warm-up: compile kernels
    t1, _ = timed_run(engine, batch=batch, prompt=prompt, new=1, flat=flat)
    tn, waits = timed_run(engine, batch=batch, prompt=prompt, new=new, flat=flat)
    gc.collect()
    torch.cuda.empty_cache()
    return {"mode": mode, "kv_dtype": engine.kv_format.name, "slice_tokens": engine.slice_tokens, **SAMPLING,
            "host_reserve_bytes": host_reserve, "host_reserve_s": engine.host_reserve_seconds,
            "batch": batch, "prefix": prefix, "new": new,
            "total_s": tn, "prefill_s": t1, "decode_tok_s": batch * (new - 1) / (tn - t1), "memory_waits": waits}


def largest_batch(model, kv_dtype: str, prefix: int, new: int) -> dict:
    """The most branches of `new` tokens below one shared `prefix` whose KV fits the budget the engine's
    admission uses (free device memory less its margin), for a KV format."""
    gc.collect()
    torch.cuda.empty_cache()
    engine = Engine(model, IdTokenizer(), kv_dtype=None if kv_dtype == "auto" else kv_dtype)
    budget = engine.start().kv_budget()
    per_token = budget.bytes_per_token
    return {"kv_dtype": engine.kv_format.name, "prefix": prefix, "new": new, "bytes_per_token": per_token,
            "budget_bytes": budget.total_bytes, "largest_batch": (budget.slots - prefix) // new}


def measure_hf(config, batch: int, prefix: int, new: int) -> list[dict]:
    """Rows for ``hf`` (``generate``) and ``hf_loop`` (a bare forward/argmax loop) on one HF model."""
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, prefix), device="cuda").repeat(batch, 1)
    mask = torch.ones_like(ids)

    def generate(n):
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    def loop(n):
        out = hf(ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(n - 1):
            out = hf(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)

    rows = []
    for mode, fn in (("hf", generate), ("hf_loop", loop)):
        def timed(n):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                fn(n)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        timed(2)
        t1, tn = timed(1), timed(new)
        rows.append({"mode": mode, "batch": batch, "prefix": prefix, "new": new, "total_s": tn, "prefill_s": t1,
                     "decode_tok_s": batch * (new - 1) / (tn - t1)})
    return rows


def flat_fits(model, batch: int, prefix: int, new: int) -> bool:
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2  # bf16 (flat runs bf16 KV only)
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return batch * (prefix + new) * per_token < 0.5 * free


def _series(r: dict) -> str:
    """A row's line in the plot: its mode, and a tree row's slices where they are not the default."""
    if r["mode"] != "tree" or r.get("slice_tokens") is None:
        return r["mode"]
    return f"tree (slices {r['slice_tokens']})"


def plot(rows: list[dict], out: Path, title: str) -> None:
    """Decode tokens/s against batch (at the base prefix) and against prefix (at the sweep's batch), per
    mode: the paper's Figures 1 and 4."""
    plt = pyplot()
    if plt is None:
        return
    ok = [r for r in rows if "decode_tok_s" in r]
    base = min((r["prefix"] for r in ok), key=lambda p: -sum(r["prefix"] == p for r in ok), default=None)
    sweep_batch = max((r["batch"] for r in ok), default=None)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x, fixed, label in ((axes[0], "batch", ("prefix", base), "batch (prefix %s)" % base),
                                (axes[1], "prefix", ("batch", sweep_batch), "prefix tokens (batch %s)" % sweep_batch)):
        for mode in dict.fromkeys(_series(r) for r in ok):
            pts = sorted((r[x], r["decode_tok_s"]) for r in ok if _series(r) == mode and r[fixed[0]] == fixed[1])
            if len(pts) > 1 or (pts and x == "batch"):
                ax.plot(*zip(*pts), marker="o", label=mode)
        ax.set_yscale("log")
        throughput_axes(ax, label)
    fig.suptitle(title)
    save(fig, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024])
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--prefix-sweep", type=int, nargs="*", default=[])
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=["tree", "none", "flat"])
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[], help="batches for HF generate")
    parser.add_argument("--kv-dtypes", nargs="+", default=["auto"], choices=["auto", "int8", "fp8"],
                        help="KV formats the tree mode runs with (auto: the model's dtype); flat and none run once")
    parser.add_argument("--slice-tokens", type=int, nargs="+", default=[0],
                        help="Engine(slice_tokens=) of the tree mode, one run each (0, the default: None, whole "
                             f"reservations; {SLICE_TOKENS} is the measured slice); flat and none run with the first")
    parser.add_argument("--host-reserve-gib", type=float, default=0.0,
                        help="host memory each engine pins when made for offloaded KV (Engine(host_reserve_bytes=), "
                             "outside the timed runs; default 0: a run short of memory pins as it offloads)")
    parser.add_argument("--temperature", type=float, default=0.0, help="the treegen modes' sampling (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="the treegen modes' nucleus (1: none)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of every mode at each point, one mode after another in each; rows report the "
                             "median round's decode tok/s (decode_tok_s_runs: every round's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    SAMPLING.update(temperature=args.temperature, top_p=args.top_p)

    config = config_of(args.shape)
    rows = []
    for b in args.hf_batches:  # HF first, on its own, then freed
        rows += measure_hf(config, b, args.prefix, args.new)
        gc.collect()  # the HF model is gone once measure_hf returns: give its memory back
        torch.cuda.empty_cache()
        print(rows[-2:], flush=True)
    model = LlamaFamilyModel.random(config, dtype=torch.bfloat16, device="cuda")
    points = [(b, args.prefix) for b in args.batches] + [(args.batches[-1], p) for p in args.prefix_sweep]
    fits = [largest_batch(model, d, args.prefix, args.new) for d in args.kv_dtypes] if len(args.kv_dtypes) > 1 else []
    for row in fits:
        print(row, flush=True)
    slices = [s or None for s in args.slice_tokens]
    runs = [(m, d, s) for m in args.modes for d in (args.kv_dtypes if m == "tree" else ["auto"])
            for s in (slices if m == "tree" else slices[:1])]
    for b, p in points:
        rounds: list[list[dict]] = [[] for _ in runs]  # each run's rows, one a round
        for _ in range(args.repeats):  # (the modes one after another in every round: drift falls on all alike)
            for j, (mode, kv_dtype, slice_tokens) in enumerate(runs):
                if mode == "flat" and not flat_fits(model, b, p, args.new):
                    row = {"mode": mode, "batch": b, "prefix": p, "new": args.new, "skipped": "KV does not fit"}
                else:
                    try:
                        row = measure_treegen(model, mode, b, p, args.new, kv_dtype, slice_tokens,
                                              int(args.host_reserve_gib * 2**30))
                    except (MemoryError, torch.cuda.OutOfMemoryError) as e:
                        row = {"mode": mode, "kv_dtype": kv_dtype, "batch": b, "prefix": p, "new": args.new,
                               "skipped": f"out of memory: {str(e)[:200]}"}
                        gc.collect()
                        torch.cuda.empty_cache()
                rounds[j].append(row)
                print(row, flush=True)
        rows += [median_row(r) for r in rounds]
        write_json(args, rows, fits)
    for r in rows:  # the issue's columns: tok_s and the ratio to the attention-free ceiling at the same point
        none = next((n for n in rows if n["mode"] == "none" and n["batch"] == r["batch"] and n["prefix"] == r["prefix"]
                     and "decode_tok_s" in n), None)
        if "decode_tok_s" in r:
            r["tok_s"] = r["decode_tok_s"]
            if none:
                r["ratio_to_none"] = r["decode_tok_s"] / none["decode_tok_s"]
    if len(args.kv_dtypes) > 1:
        print("\n## tree mode by KV format — decode tokens/s (ratio to none)\n")
        print("| batch | prefix | " + " | ".join(args.kv_dtypes) + " |")
        print("|---|---|" + "---|" * len(args.kv_dtypes))
        for b, p in sorted({(r["batch"], r["prefix"]) for r in rows}):
            cells = []
            for d in args.kv_dtypes:
                name = "bfloat16" if d == "auto" else d  # rows name the format (auto: the model's bf16)
                r = next((r for r in rows if r["mode"] == "tree" and r.get("kv_dtype") == name
                          and r["batch"] == b and r["prefix"] == p), None)
                cells.append(f"{r['tok_s']:,.0f} ({r.get('ratio_to_none', float('nan')):.2f})" if r and "tok_s" in r else "-")
            print(f"| {b} | {p} | " + " | ".join(cells) + " |")

    first = f"KV {args.kv_dtypes[0]}" + (f", slice {args.slice_tokens[0]}" if len(args.slice_tokens) > 1 else "")
    print(f"\n## {args.shape}, bf16 weights, {first}, {args.new} new tokens — decode tokens/s (total s incl. prefill)\n")
    baselines = ["hf", "hf_loop"] if args.hf_batches else []
    print("| batch | prefix | " + " | ".join(baselines + args.modes) + " | tree / none | tree / hf | tree / hf_loop |")
    print("|---|---|" + "---|" * (len(baselines + args.modes) + 3))
    for b, p in sorted({(r["batch"], r["prefix"]) for r in rows}):
        by = {}  # each mode's first run: the first KV format and slice asked for (the tree mode runs one per format)
        for r in rows:
            if r["batch"] == b and r["prefix"] == p:
                by.setdefault(r["mode"], r)
        cell = lambda m: (f"{by[m]['decode_tok_s']:,.0f} ({by[m]['total_s']:.2f})" if m in by and "decode_tok_s" in by[m]  # noqa: E731
                          else ("does not fit" if m in by else "-"))
        ratio = lambda a, c: (f"{by[a]['decode_tok_s'] / by[c]['decode_tok_s']:.2f}"  # noqa: E731
                              if a in by and c in by and "decode_tok_s" in by[a] and "decode_tok_s" in by[c] else "-")
        print(f"| {b} | {p} | " + " | ".join(cell(m) for m in baselines + args.modes)
              + f" | {ratio('tree', 'none')} | {ratio('tree', 'hf')} | {ratio('tree', 'hf_loop')} |")
    out = write_json(args, rows, fits)
    print(f"wrote {out}")
    plot(rows, out.with_suffix(".png"), f"{args.shape} shape, bf16, {torch.cuda.get_device_name()}")


def median_run(runs: list[dict], key: str) -> dict:
    """The run with the median ``key`` (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


def median_row(runs: list[dict]) -> dict:
    """One row for a mode's rounds at a point: the round of the median decode tok/s, with every round's figures
    beside it; a round that did not run (skipped) stands for all when any did not."""
    if any("decode_tok_s" not in r for r in runs):
        return next(r for r in runs if "decode_tok_s" not in r)
    row = dict(median_run(runs, "decode_tok_s"))
    if len(runs) > 1:
        row.update(rounds=len(runs), decode_tok_s_runs=[r["decode_tok_s"] for r in runs],
                   total_s_runs=[r["total_s"] for r in runs])
    return row


def write_json(args, rows: list[dict], fits: list[dict]) -> Path:
    """The results so far (written after every point: a run cut short keeps what it measured)."""
    result = {"benchmark": "end_to_end", "shape": args.shape, "config": SHAPES[args.shape], "dtype": "bfloat16",
              "device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                           "cuda": torch.version.cuda, "python": platform.python_version()},
              "method": "decode tok/s = batch*(new-1)/(t(new)-t(1)); "
                        f"temperature {args.temperature}, top-p {args.top_p} (treegen modes), EOS ignored; one warm-up run per point; "
                        f"{args.repeats} round(s) of the modes in turn, the median round's figures",
              # each row names the model and the path that ran it (treegen's fast forward; HF rows say hf)
              "rows": [{"model": args.shape, "path": r["mode"] if r["mode"].startswith("hf") else "fast", **r}
                       for r in rows]}
    if fits:
        result["largest_batch"] = fits
    out = Path(args.out or Path(__file__).parent / "results" / f"end_to_end_{args.shape}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
