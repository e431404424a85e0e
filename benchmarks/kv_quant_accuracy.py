"""Accuracy of the 8-bit KV cache (issue 15): each ``kv_dtype`` ("int8", "fp8") against the model dtype.

Model: the embedded SmolLM2-135M-Instruct (``Engine.load(None)``), fp32 on the CPU by default; on a GPU
``--device cuda --dtype bfloat16``. Every format runs on the same loaded weights (one ``Engine`` per
``kv_dtype`` around the same model), so the KV storage is the only difference.

Text: ``benchmarks/data/persuasion_ch1.txt`` (chapter 1 of Jane Austen's *Persuasion*, public domain;
see ``benchmarks/data/README.md``), tokenized without special tokens: 3,700 tokens.

Method
------
* **Teacher-forced next-token distributions**: per format, one tree run holds the text as a single
  root node, grown and prefilled ``--window`` tokens at a time (default 1,024; ``tree.extend`` +
  ``TreeRun.prefill``: one forward pass per chunk). So every token is computed once, with the whole
  text before it as context, and reads the earlier tokens' keys/values back from the KV cache — in the
  8-bit formats quantized when written and dequantized when read, as in serving (the chunk's own keys
  too: they are written to the cache before attention reads it). Every format runs in turn on the
  same chunk; every prediction of tokens 1 .. n-1 is scored once (n - 1 positions). Per format:
  - perplexity of the text ``exp(mean NLL)``; against the model dtype its relative increase
    ``ppl / ppl_ref - 1``;
  - mean KL divergence ``KL(p_ref || p_fmt)`` of the next-token distributions (nats per position),
    and the largest;
  - max and mean absolute logit error ``|logit_fmt - logit_ref|`` over positions x vocabulary;
  - top-1 agreement: the fraction of positions whose argmax tokens are the same.
  Statistics are computed in float64 from the engine's fp32 logits.
* **Greedy agreement**: ``--prompts`` prompts (default 50), each a window of ``--prompt-tokens`` text
  tokens (default 64) at evenly spaced offsets across the text (with the defaults: disjoint windows).
  Per format, one tree run with one root per prompt and a greedy branch under each (EOS ignored), all
  decoding together, ``--new-tokens`` tokens each (default 64). Per prompt, the tokens until the first
  divergence from the model-dtype generation (``new_tokens`` when identical); reported as mean / median
  / min and the fraction of prompts whose generation is fully identical. (Prompts are kept short so
  the run stays within a few minutes on 2 CPU cores: the prompts' prefill costs as much as the text's.)

Writes ``benchmarks/results/kv_quant_accuracy_<device>.json`` (``cpu``, or the GPU's short name such as
``h100``) and prints a table.

    HF_HUB_OFFLINE=1 python benchmarks/kv_quant_accuracy.py                       # CPU, fp32 (a few minutes on 2 cores)
    HF_HUB_OFFLINE=1 python benchmarks/kv_quant_accuracy.py --device cuda --dtype bfloat16
    options: --formats int8 fp8  --window 1024  --prompts 50  --prompt-tokens 64  --new-tokens 64
             --text-tokens N (quick checks)  --out PATH
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.loader import load_model
from treegen.runtime.sampler import SamplingParams

HERE = Path(__file__).resolve().parent
TEXT = HERE / "data" / "persuasion_ch1.txt"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_slug(device: torch.device) -> str:
    """``cpu``, or a short GPU name (``h100``, ``h200``, ``a100``, ...) for the result file."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")).lower()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------ runs
class TextRun:
    """One format's tree run holding the text as one root node, grown and prefilled a chunk at a time."""

    def __init__(self, engine: Engine) -> None:
        self.run = engine.start()
        self.node = self.run.tree.add_node(None)

    def prefill(self, chunk: list[int]) -> torch.Tensor:
        """Append ``chunk`` to the text and compute it (attending to the text so far through the KV
        cache) → fp32 logits [len(chunk), vocab]; row j predicts the token after the chunk's j-th."""
        self.run.tree.extend(self.node, chunk)
        return self.run.prefill([self.node])[self.node]


def prompt_starts(n_tokens: int, prompts: int, length: int) -> list[int]:
    """First token of each greedy prompt: ``prompts`` windows of ``length`` tokens, evenly spaced."""
    last = n_tokens - length
    if last < 0:
        raise ValueError(f"the text has {n_tokens} tokens, fewer than --prompt-tokens {length}")
    return [round(i * last / max(1, prompts - 1)) for i in range(prompts)]


def greedy(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[tuple[int, ...]]:
    """Greedy generations of ``new_tokens`` tokens (EOS ignored) after each prompt, all in one run."""
    run = engine.start()
    leaves = [run.tree.add_node(run.tree.add_node(None, p)) for p in prompts]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    results, _ = run.execute([GenRequest(leaf, params, key=i, final=True) for i, leaf in enumerate(leaves)], [])
    assert all(len(r.tokens) == new_tokens for r in results)
    return [r.tokens for r in results]


# ------------------------------------------------------------------------------ statistics
class Stats:
    """Accumulates, over scored positions, one format's perplexity and its error against the reference."""

    def __init__(self) -> None:
        self.positions = 0
        self.nll = 0.0
        self.kl_sum = 0.0
        self.kl_max = 0.0
        self.abs_err_sum = 0.0
        self.abs_err_max = 0.0
        self.top1_same = 0
        self.values = 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor | None) -> None:
        logits = logits.double()
        logp = logits.log_softmax(-1)
        self.positions += logits.shape[0]
        self.nll -= logp.gather(1, targets.unsqueeze(1)).sum().item()
        if ref is None:
            return
        ref = ref.double()
        ref_logp = ref.log_softmax(-1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
        self.kl_sum += kl.sum().item()
        self.kl_max = max(self.kl_max, kl.max().item())
        err = (logits - ref).abs()
        self.abs_err_sum += err.sum().item()
        self.abs_err_max = max(self.abs_err_max, err.max().item())
        self.values += err.numel()
        self.top1_same += (logits.argmax(-1) == ref.argmax(-1)).sum().item()

    def perplexity(self) -> float:
        return math.exp(self.nll / self.positions)

    def summary(self, ref: "Stats | None") -> dict:
        out = {"positions": self.positions, "mean_nll": self.nll / self.positions, "perplexity": self.perplexity()}
        if ref is not None:
            out |= {
                "perplexity_increase": self.perplexity() / ref.perplexity() - 1.0,
                "mean_kl": self.kl_sum / self.positions,
                "max_kl": self.kl_max,
                "max_abs_logit_error": self.abs_err_max,
                "mean_abs_logit_error": self.abs_err_sum / self.values,
                "top1_agreement": self.top1_same / self.positions,
            }
        return out


def teacher_forced(engines: dict, ids: list[int], window: int, device: torch.device) -> tuple[dict, dict]:
    """The text in chunks of ``window`` tokens, every format in turn on each chunk (the reference
    first); returns per-format :class:`Stats` and seconds."""
    runs = {name: TextRun(engine) for name, engine in engines.items()}
    stats = {name: Stats() for name in runs}
    seconds = dict.fromkeys(runs, 0.0)
    for begin in range(0, len(ids), window):
        end = min(begin + window, len(ids))
        scored = min(end, len(ids) - 1) - begin  # the text's last token predicts nothing
        targets = torch.tensor(ids[begin + 1 : begin + 1 + scored], dtype=torch.int64, device=device)
        ref = None
        for name, text_run in runs.items():
            start = time.perf_counter()
            logits = text_run.prefill(ids[begin:end])[:scored]
            synchronize(device)
            seconds[name] += time.perf_counter() - start
            stats[name].add(logits, targets.to(logits.device), ref)
            if ref is None:
                ref = logits
    return stats, seconds


def until_divergence(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--model", default=None, help="a checkpoint path or hub id (default: the embedded SmolLM2)")
    parser.add_argument("--formats", nargs="*", default=["int8", "fp8"], help="8-bit kv_dtype values to compare")
    parser.add_argument("--window", type=int, default=1024, help="text tokens prefilled per forward pass")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens of each greedy prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--text-tokens", type=int, default=None, help="use only the text's first N tokens (quick checks)")
    parser.add_argument("--out", default=None, help="JSON path (default: results/kv_quant_accuracy_<device>.json)")
    args = parser.parse_args()
    if args.window < 1:
        parser.error("--window must be >= 1")

    t_all = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype], device=args.device)
    device = model.device
    engines = {"model": Engine(model, tokenizer)}
    for fmt in args.formats:
        engines[fmt] = Engine(model, tokenizer, kv_dtype=fmt)
    text = TEXT.read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False).input_ids[: args.text_tokens]
    print(f"{TEXT.name}: {len(ids)} tokens; model {args.model or 'SmolLM2-135M-Instruct'} ({args.dtype}) on {device}; "
          f"torch threads {torch.get_num_threads()}", flush=True)

    if len(ids) > model.max_context:
        parser.error(f"the text's {len(ids)} tokens exceed the model's context of {model.max_context}")
    starts = prompt_starts(len(ids), args.prompts, args.prompt_tokens)
    prompts = [ids[s : s + args.prompt_tokens] for s in starts]

    with torch.no_grad():
        start = time.perf_counter()
        stats, tf_seconds = teacher_forced(engines, ids, args.window, device)
        print(f"teacher-forced: {stats['model'].positions} positions x {len(engines)} formats "
              f"in {time.perf_counter() - start:.1f} s", flush=True)

        generations, gen_seconds = {}, {}
        for name, engine in engines.items():
            start = time.perf_counter()
            generations[name] = greedy(engine, prompts, args.new_tokens)
            synchronize(device)
            gen_seconds[name] = time.perf_counter() - start
            print(f"greedy {name}: {len(prompts)} prompts x {args.new_tokens} tokens in {gen_seconds[name]:.1f} s",
                  flush=True)

    ref_name = f"model ({args.dtype})"
    rows = []
    for name in engines:
        is_ref = name == "model"
        row = {"kv_dtype": ref_name if is_ref else name, "reference": is_ref,
               **stats[name].summary(None if is_ref else stats["model"])}
        if not is_ref:
            agree = [until_divergence(a, b) for a, b in zip(generations[name], generations["model"])]
            row["greedy"] = {
                "prompts": len(agree), "new_tokens": args.new_tokens,
                "tokens_until_divergence_mean": statistics.fmean(agree),
                "tokens_until_divergence_median": statistics.median(agree),
                "tokens_until_divergence_min": min(agree),
                "fraction_identical": sum(a == args.new_tokens for a in agree) / len(agree),
                "per_prompt": agree,
            }
        row["seconds"] = {"teacher_forced": round(tf_seconds[name], 2), "greedy": round(gen_seconds[name], 2)}
        rows.append(row)

    print(f"\n{TEXT.name}, {len(ids)} tokens, full context; greedy: {len(prompts)} prompts of {args.prompt_tokens} "
          f"tokens, {args.new_tokens} new each")
    print("| kv_dtype | perplexity | ppl increase | mean KL | max KL | max abs logit err | mean abs logit err "
          "| top-1 agree | greedy until divergence mean / median / min | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["reference"]:
            print(f"| {r['kv_dtype']} | {r['perplexity']:.4f} | — | — | — | — | — | — | — | — |")
            continue
        g = r["greedy"]
        print(f"| {r['kv_dtype']} | {r['perplexity']:.4f} | {100 * r['perplexity_increase']:+.3f}% "
              f"| {r['mean_kl']:.2e} | {r['max_kl']:.2e} | {r['max_abs_logit_error']:.4f} | {r['mean_abs_logit_error']:.2e} "
              f"| {100 * r['top1_agreement']:.2f}% | {g['tokens_until_divergence_mean']:.1f} / "
              f"{g['tokens_until_divergence_median']:g} / {g['tokens_until_divergence_min']} "
              f"| {100 * g['fraction_identical']:.0f}% |")

    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    result = {
        "benchmark": "kv_quant_accuracy",
        "device": device_name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "torch_threads": torch.get_num_threads(),
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "dtype": args.dtype,
        "text": {"file": str(TEXT.relative_to(HERE.parent)), "tokens": len(ids)},
        "method": {"context": "full (the text is one node, prefilled in chunks)", "chunk": args.window,
                   "prompts": len(prompts), "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                   "prompt_starts": starts},
        "rows": rows,
        "seconds_total": round(time.perf_counter() - t_all, 1),
    }
    out = Path(args.out) if args.out else HERE / "results" / f"kv_quant_accuracy_{device_slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
