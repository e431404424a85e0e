"""The LM head split by vocabulary under tensor parallel (CPU, gloo, 2 processes): the tokens of one
process (greedy, seeded sampling with and without top-p / top-k, constrained gens), log-probabilities,
``select`` scores and prefill logits within 1e-5; an odd vocabulary 2 does not divide; a tied head; the
head split or whole, under torchrun and from a plain process; bad values refused before loading."""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from test_distributed import checkpoint  # noqa: F401 - the shared fixture
from treegen.runtime.engine import Engine
from treegen.runtime.shard import Shard, TensorParallelError, vocab_parallel_for
from vocab_parallel_programs import assert_close, runtime_workload

WORKER = Path(__file__).with_name("vocab_parallel_programs.py")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def one_process(checkpoint):  # noqa: F811
    return runtime_workload(Engine.load(str(checkpoint)), constrained=True)


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def ranks(out: Path) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


def test_odd_and_tied_vocabularies_split_or_whole_give_the_tokens_of_one_process(tmp_path):
    done = torchrun("random", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-4000:]
    for got in ranks(tmp_path / "out"):
        assert got["checked"] == ["vocab 1001, head split", "vocab 1001, head whole",
                                  "vocab 999 tied, head split", "vocab 999 tied, head whole"]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_checkpoint_under_torchrun_gives_the_tokens_of_one_process(checkpoint, one_process, tmp_path, mode):  # noqa: F811
    done = torchrun(str(checkpoint), str(tmp_path / "out"), "--vocab-parallel", mode)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank, got in enumerate(ranks(tmp_path / "out")):
        split = got.pop("_vocab_split")
        # 49152 tokens: 24576 a rank (the safetensors reader took only this rank's rows of lm_head.weight)
        assert split == ([[0, 24576, 24576], [24576, 49152, 24576]][rank] if mode == "on" else None)
        assert_close(got, one_process, f"rank {rank}, vocab_parallel {mode}")


def test_a_plain_process_drives_a_split_head_to_the_tokens_of_one(checkpoint, one_process):  # noqa: F811
    engine = Engine.load(str(checkpoint), tensor_parallel=2, vocab_parallel=True)
    try:
        assert engine.model.vocab_split is not None and engine.model.lm_head.shape[0] == 24576
        assert "LM head split by vocabulary" in repr(engine.parallel)
        assert_close(runtime_workload(engine, constrained=True), one_process, "spawned workers, split head")
    finally:
        engine.close()


def test_vocabulary_slices():
    assert [Shard(r, 2).vocab(49152) for r in range(2)] == [(0, 24576), (24576, 49152)]
    assert [Shard(r, 2).vocab(1001) for r in range(2)] == [(0, 512), (512, 1001)]
    assert [Shard(r, 4).vocab(128256) for r in range(4)] == [(0, 32064), (32064, 64128), (64128, 96192),
                                                              (96192, 128256)]
    assert [Shard(r, 3).vocab(100) for r in range(3)] == [(0, 64), (64, 100), (100, 100)]  # too small: see below
    assert vocab_parallel_for("auto", 2, 49152) is True
    assert vocab_parallel_for("auto", 1, 49152) is False
    assert vocab_parallel_for("auto", 3, 100) is False  # the last rank would hold nothing: whole head
    assert vocab_parallel_for(False, 2, 49152) is False and vocab_parallel_for(True, 2, 49152) is True


def test_bad_vocab_parallel_values_are_refused_before_loading(checkpoint):  # noqa: F811
    with pytest.raises(TensorParallelError, match="vocab_parallel=True .* needs tensor_parallel > 1"):
        Engine.load(str(checkpoint), vocab_parallel=True)
    with pytest.raises(TensorParallelError, match="vocab_parallel must be True, False or 'auto', got 'yes'"):
        Engine.load(str(checkpoint), tensor_parallel=2, vocab_parallel="yes")
    with pytest.raises(TensorParallelError, match="vocab_parallel must be True, False or 'auto', got 1"):
        Engine.load(str(checkpoint), tensor_parallel=2, vocab_parallel=1)
    with pytest.raises(TensorParallelError, match="too small to split over 3 ranks"):
        vocab_parallel_for(True, 3, 100)


def test_the_command_line_takes_vocab_parallel(checkpoint, tmp_path, capsys):  # noqa: F811
    from treegen.cli import EXIT_USAGE, main

    prog = tmp_path / "p.tg"
    prog.write_text('"Hello"\ngen x(max_tokens=2)\n')
    assert main(["run", str(prog), "--model", str(checkpoint), "--vocab-parallel", "on", "--no-progress"]) == EXIT_USAGE
    assert "vocab_parallel=True splits the LM head over tensor-parallel ranks: it needs tensor_parallel > 1" \
        in capsys.readouterr().err
