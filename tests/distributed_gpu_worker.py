"""The two-GPU checks of tests/test_distributed_gpu.py, run by ``torchrun --nproc-per-node 2``; raises
(exit status 1) on any mismatch.

* tp=2 vs tp=1: bf16 logits of a prefilled tree on a random model of Llama-3-8B's layer shape
  (hidden 4096, 32/8 heads, MLP 14336, vocab 128256; 4 layers), within bf16 tolerance; then a
  greedy decode at tp=2 through CUDA graphs gives the same tokens on both ranks.
* the all-reduce over peer memory gives NCCL's sums (fp32 bit for bit, bf16 within one step; the same
  bits on both ranks), also replayed in a CUDA graph.
* dp=2 vs one process: a two-level batch (sampled and greedy, fp32) gives identical tokens.
"""

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"

import torch
import torch.distributed as dist
from transformers import LlamaConfig

import treegen
from treegen.runtime.distributed import init_parallel
from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.sampler import SamplingParams


def prefill_logits(engine: Engine) -> torch.Tensor:
    run = engine.start()
    gen = torch.Generator().manual_seed(1)
    root = run.tree.add_node(None, torch.randint(0, 128256, (300,), generator=gen).tolist())
    leaves = [run.tree.add_node(root, torch.randint(0, 128256, (n,), generator=gen).tolist()) for n in (17, 37, 1)]
    out = run.prefill([root, *leaves])
    return torch.cat([out[n] for n in [root, *leaves]])


def greedy_tokens(engine: Engine) -> list:
    run = engine.start()
    root = run.tree.add_node(None, list(range(100, 400)))
    leaves = [run.tree.add_node(root, [7 + i]) for i in range(8)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    results, _ = run.execute([GenRequest(leaf, params, key=i, final=True) for i, leaf in enumerate(leaves)], [])
    assert run.decode_phases, "the branches never decoded in a phase"
    return [list(r.tokens) for r in results]


@treegen.program
def problem(s, k):
    s += " ".join(str(10 + t) for t in range(64))  # a shared prefix (IdTokenizer: ids written as text)
    s += f" {200 + k} {300 + k}"
    b = s.fork(3)
    b += treegen.gen("x", max_tokens=12, temperature=0.8, ignore_eos=True)
    s.join(b)
    s += treegen.gen("greedy", max_tokens=6, ignore_eos=True)


def peer_all_reduce_is_nccls(tp2) -> None:
    """The all-reduce over peer memory gives NCCL's sums, the same bits on every rank, for the sizes and dtypes the
    model sends it (in and out of a CUDA graph); a tensor larger than its buffer goes to NCCL."""
    peer = tp2.tensor.peer
    assert peer is not None, f"tp=2 on two GPUs of one host did not use peer memory: {tp2.tensor.all_reduce_path}"
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 3, 64, 1000):
            x = torch.randn(rows, 4096, dtype=dtype, device=tp2.device) * (1 + tp2.rank)
            want = x.clone()
            dist.all_reduce(want, group=tp2.tensor.group)
            got = tp2.tensor.all_reduce(x.clone())
            if dtype == torch.float32:  # a + b, exactly as NCCL
                assert torch.equal(got, want), (dtype, rows, (got - want).abs().max().item())
            else:  # bf16 sums may round once or twice: within one bf16 step of NCCL's
                torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
            every = [torch.empty_like(got) for _ in range(2)]
            dist.all_gather(every, got, group=tp2.tensor.group)
            assert torch.equal(every[0], every[1]), "the ranks' sums differ"
    x = torch.randn(64, 4096, dtype=torch.bfloat16, device=tp2.device) + tp2.rank
    want = x.clone()
    dist.all_reduce(want, group=tp2.tensor.group)
    y = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tp2.tensor.all_reduce(y)
    for _ in range(3):
        y.copy_(x)
        graph.replay()
        torch.testing.assert_close(y, want, rtol=2**-7, atol=0)
    big = torch.ones(peer.nbytes // 2 + 8, dtype=torch.bfloat16, device=tp2.device)
    assert not peer.fits(big) and torch.equal(tp2.tensor.all_reduce(big), torch.full_like(big, 2))


def main() -> None:
    tp2 = init_parallel(tensor_parallel=2, device="cuda", timeout_s=600)
    peer_all_reduce_is_nccls(tp2)
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
    whole = Engine(LlamaFamilyModel.random(cfg, device=tp2.device), IdTokenizer())
    split = Engine(LlamaFamilyModel.random(cfg, device=tp2.device, tp=tp2.tensor), IdTokenizer(), parallel=tp2)
    assert split.model.num_heads == 16 and split.model.num_kv_heads == 4, split.model
    want, got = prefill_logits(whole), prefill_logits(split)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=0.03 * scale, rtol=0.03)
    same = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert same > 0.9, f"tp=2 and tp=1 agree on the top token of only {same:.0%} of the rows"
    tokens = greedy_tokens(split)
    every = [None, None]
    dist.all_gather_object(every, tokens)
    assert every[0] == every[1], "tp=2 ranks drew different tokens"
    del whole, split
    torch.cuda.empty_cache()

    dp2 = init_parallel(tensor_parallel=1, data_parallel=2, device="cuda", timeout_s=600)
    small = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096)
    model = LlamaFamilyModel.random(small, dtype=torch.float32, device=dp2.device)
    inputs = [{"k": k} for k in range(8)]
    alone = problem.run_batch(Engine(model, IdTokenizer()), inputs, seed=5)
    replicas = problem.run_batch(Engine(model, IdTokenizer(), parallel=dp2), inputs, seed=5)
    assert [(r["x"], r["greedy"]) for r in replicas] == [(r["x"], r["greedy"]) for r in alone], "dp=2 tokens differ"
    if dp2.rank == 0:
        print(f"{tp2}", flush=True)
        print("distributed GPU checks passed: peer all-reduce equals NCCL's, tp=2 logits within bf16 tolerance "
              f"(top token agrees on {same:.0%} of rows), dp=2 tokens identical", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
