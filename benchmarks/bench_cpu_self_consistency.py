"""CPU benchmark: N samples of one few-shot prompt on SmolLM2, treegen vs Hugging Face generate.

Both sides sample exactly 64 new tokens per sequence (temperature 0.7, EOS ignored) from the same
prompt in the same process. Hugging Face `generate(num_return_sequences=N)` copies the prompt N times
(N prefills, N KV copies); treegen prefills the prompt once and decodes the N branches together over
the shared node. Reports the best of --repeats wall times, a table on stdout and JSON under
benchmarks/results/.

    python benchmarks/bench_cpu_self_consistency.py [--samples 4 8 16] [--new-tokens 64] [--repeats 2]
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from transformers import AutoModelForCausalLM

import treegen
from treegen.runtime.loader import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from self_consistency import FEW_SHOT, QUESTION  # noqa: E402

PROMPT = FEW_SHOT + f"Q: {QUESTION}\nA:"


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_self_consistency.json"))
    args = parser.parse_args()

    engine = treegen.Engine.load()
    hf = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    prompt_ids = torch.tensor([engine.tokenizer(PROMPT, add_special_tokens=False).input_ids])

    @treegen.program
    def sample_n(s, n):
        s += PROMPT
        b = s.fork(n)
        b += treegen.gen("x", max_tokens=args.new_tokens, temperature=0.7, ignore_eos=True)
        s.join(b)

    rows = []
    for n in args.samples:
        def run_treegen():
            out = sample_n.run(engine, n)
            assert all(st.info["x"]["tokens"] == args.new_tokens for st in out._run.states[1:])

        def run_hf():
            with torch.no_grad():
                out = hf.generate(prompt_ids, do_sample=True, temperature=0.7, top_p=1.0, top_k=0,
                                  num_return_sequences=n, max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, pad_token_id=engine.tokenizer.eos_token_id)
            assert out.shape == (n, prompt_ids.shape[1] + args.new_tokens)

        run_treegen(), run_hf()  # warm-up
        t_tree, t_hf = best_time(run_treegen, args.repeats), best_time(run_hf, args.repeats)
        rows.append({"samples": n, "prompt_tokens": prompt_ids.shape[1], "new_tokens": args.new_tokens,
                     "treegen_s": round(t_tree, 3), "hf_generate_s": round(t_hf, 3),
                     "treegen_tok_s": round(n * args.new_tokens / t_tree, 1),
                     "hf_tok_s": round(n * args.new_tokens / t_hf, 1), "speedup": round(t_hf / t_tree, 2)})
        print(rows[-1], flush=True)

    print("\n| samples | prompt | new | treegen s | HF generate s | treegen tok/s | HF tok/s | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['samples']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['treegen_s']} | {r['hf_generate_s']} "
              f"| {r['treegen_tok_s']} | {r['hf_tok_s']} | {r['speedup']}x |")
    result = {
        "benchmark": "cpu_self_consistency", "model": "SmolLM2-135M-Instruct (fp32)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "treegen": "0.1.0"},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
