"""Test-wide environment: never touch the network; run Triton kernels in the interpreter unless told otherwise."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device and compiled kernels (``TRITON_INTERPRET=0``): skipped otherwise."""
    import torch

    if not torch.cuda.is_available():
        reason = "needs a CUDA device"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        reason = "set TRITON_INTERPRET=0 to compile kernels"
    else:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M-Instruct on an Engine (fp32, CPU)."""
    from treegen.runtime.engine import Engine

    return Engine.load()


@pytest.fixture(scope="session")
def hf_smol():
    """Hugging Face's model on the same converted weights, for exactness checks."""
    import torch
    from transformers import AutoModelForCausalLM

    from treegen.runtime.loader import default_model_path

    return AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama():
    """(HF model, our model) of a random Llama with GQA (4 query / 2 KV heads), the SmolLM2 vocabulary
    size (so its tokenizer works with it), 2 layers; fp32, CPU."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from treegen.runtime.model import LlamaFamilyModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    return hf, LlamaFamilyModel.from_hf(hf)


@pytest.fixture(scope="session")
def model64():
    """A tiny random GQA Llama with head_dim 64, which the Triton kernels take (2 query / 1 KV heads)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from treegen.runtime.model import LlamaFamilyModel

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    return LlamaFamilyModel.from_hf(AutoModelForCausalLM.from_config(cfg).eval())


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded SmolLM2 tokenizer."""
    from treegen.runtime.loader import load_tokenizer

    return load_tokenizer()


@pytest.fixture
def short_library_chunks(monkeypatch):
    """The library segment cut into chunks of ~512 keys however few tiles they make, as the planner did before its
    measured limits (``triton_plan._LIBRARY_MIN_CHUNK`` 2,048, ``_LIBRARY_MIN_PROGRAMS`` half a wave) and still does
    over an 8-bit cache: for tests of how several chunks are cut, merged and read by row on small trees — the same
    code serves the planner's."""
    from treegen.kernels import triton_plan
    monkeypatch.setattr(triton_plan, "_LIBRARY_MIN_CHUNK", 512)
    monkeypatch.setattr(triton_plan, "_LIBRARY_MIN_PROGRAMS", 0)
