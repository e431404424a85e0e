"""Decode throughput of branches with stop strings against the same branches without, in one run.

A gen with stop strings ends at the first token after which its text holds one; the host finds that
with one batched decode of each branch's text tail per block of tokens
(:mod:`treegen.runtime.stop_strings`), and decodes a whole text only where a stop string may have
appeared. ``exact`` is the check this replaced, timed in the same run: the branch's whole text
decoded after every token. Random weights of a real model shape with the vocabulary of the embedded
model's real tokenizer (SmolLM2's, 49,152 byte-level BPE tokens: the decode cost is a real
tokenizer's), bf16, CUDA graphs, one shared prompt of ``--prefix`` random tokens below ``batch``
branches sampling at temperature 1 with EOS ignored; the stop strings (``"\\n\\nQuestion:"``,
``"</answer>"``) never occur in random text, so every branch makes exactly ``--new`` tokens in every
variant (checked). Decode tok/s = batch x (new - 1) / (t(new) - t(1)), medians of ``--repeats`` runs
after a warm-up, the variants interleaved; ``ratio_to_no_stop`` is against ``none`` at the same batch in
the same process.

    python benchmarks/bench_stop_strings.py --batches 256 1024
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from pathlib import Path

import torch
import transformers

from treegen.runtime.stop_strings import StopStrings
from treegen.runtime.engine import Engine
from treegen.runtime.model import LlamaFamilyModel
import bench_end_to_end  # benchmarks/
from bench_end_to_end import SHAPES, config_of

STOPS = ("\n\nQuestion:", "</answer>")
VARIANTS = ("none", "stop", "exact")  # no stop strings; stop strings (tail test); the check after every token


def timed(engine: Engine, prompt: list[int], batch: int, new: int, stop: tuple[str, ...]) -> float:
    """bench_end_to_end's run of ``batch`` branches below ``prompt`` (every one must make ``new`` tokens: a
    stop string met in random text would fail it), sampling at temperature 1 with ``stop``; its seconds."""
    bench_end_to_end.SAMPLING.update(temperature=1.0, top_p=1.0, stop=stop)
    return bench_end_to_end.timed_run(engine, batch=batch, prompt=prompt, new=new, flat=False)[0]


class Variant:
    """How one variant runs: its stop strings, and (``exact``) the tail test replaced by "maybe" everywhere."""

    def __init__(self, name: str) -> None:
        self.name, self.stop = name, () if name == "none" else STOPS

    def __enter__(self):
        self.real = StopStrings.may_stop
        if self.name == "exact":  # every block "may stop": the whole text decoded after each token, as before
            StopStrings.may_stop = lambda self, outs, news, stops: [True] * len(outs)
        return self

    def __exit__(self, *exc):
        StopStrings.may_stop = self.real


def measure(engine, prompt, batch: int, new: int, variants: list[str], repeats: int) -> list[dict]:
    """Each variant's decode tok/s at ``batch``: warm-ups first, then ``repeats`` rounds that run every
    variant once (interleaved, so drift of the machine falls on all alike); medians."""
    for name in variants:
        with Variant(name) as v:
            timed(engine, prompt, batch, 8, v.stop)  # warm-up: kernels, graphs, the stop test's table
    first, full = {n: [] for n in variants}, {n: [] for n in variants}
    for _ in range(repeats):
        for name in variants:
            with Variant(name) as v:
                first[name].append(timed(engine, prompt, batch, 1, v.stop))
                full[name].append(timed(engine, prompt, batch, new, v.stop))
    rows = []
    for name in variants:
        t1, tn = statistics.median(first[name]), statistics.median(full[name])
        rows.append({"variant": name, "batch": batch, "new": new, "stop": list(Variant(name).stop), "total_s": tn,
                     "prefill_s": t1, "runs_s": full[name], "decode_tok_s": batch * (new - 1) / (tn - t1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the embedded model's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tokenizer:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from treegen.runtime.loader import load_tokenizer
        tokenizer = load_tokenizer()
    config = config_of(args.shape)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = LlamaFamilyModel.random(config, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, tokenizer)
    prompt = torch.randint(0, config.vocab_size, (args.prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for batch in args.batches:
        measured = measure(engine, prompt, batch, args.new, args.variants, args.repeats)
        base = next((r["decode_tok_s"] for r in measured if r["variant"] == "none"), None)
        for row in measured:
            row["ratio_to_no_stop"] = row["decode_tok_s"] / base if base else None
            rows.append(row)
            print({k: v for k, v in row.items() if k != "runs_s"}, flush=True)
    out = Path(args.out or Path(__file__).parent / "results" / f"stop_strings_{args.shape}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "bench_stop_strings", "shape": args.shape, "vocab_size": config.vocab_size,
        "tokenizer": type(tokenizer).__name__, "prefix": args.prefix, "dtype": "bfloat16",
        "device": torch.cuda.get_device_name(), "repeats": args.repeats,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "method": __doc__.split("\n\n")[1].replace("\n", " "), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
