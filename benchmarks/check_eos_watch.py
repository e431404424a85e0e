"""Does reading the device's count of live rows every step (decode.WATCH_LAG) slow a decode phase? The
same 256 branches x 128 tokens (TinyLlama shape, random weights, bf16, CUDA graphs) with EOS ignored (no
watch) and not ignored (watched; random weights rarely draw EOS), alternated, in one process."""
import time

import torch
from transformers import LlamaConfig

from bench_end_to_end import SHAPES
from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.sampler import SamplingParams

model = LlamaFamilyModel.random(LlamaConfig(**SHAPES["tinyllama-1.1b"]), dtype=torch.bfloat16, device="cuda")
engine = Engine(model, IdTokenizer())
prompt = torch.randint(3, model.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).tolist()
times = {True: [], False: []}
for rep in range(4):
    for ignore in (True, False):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run = engine.start()
        root = run.tree.add_node(None, prompt)
        reqs = [GenRequest(run.tree.add_node(root), SamplingParams(max_tokens=128, temperature=1.0, ignore_eos=ignore),
                           key=i) for i in range(256)]
        results, _ = run.execute(reqs, [])
        torch.cuda.synchronize()
        if rep:
            times[ignore].append(time.perf_counter() - t0)
        print(ignore, rep, round(time.perf_counter() - t0, 3), run.forward_passes, run.decoder.early_ends,
              sum(len(r.tokens) for r in results), flush=True)
print("median s, EOS ignored (no watch):", sorted(times[True])[1], " watched:", sorted(times[False])[1])
