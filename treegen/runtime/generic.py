"""The generic path: any decoder-only causal LM of transformers, run by its own modules.

:class:`GenericModel` wraps an HF ``*ForCausalLM`` and presents the runtime the same forward as the
fast path's :class:`~treegen.runtime.model.LlamaFamilyModel` — packed tokens ``[T]``, their positions
in their own sequences, and a per-layer ``attend(layer, q, k, v)`` callback that stores the new keys
and values in treegen's per-node KV store and runs tree attention — so memory and attention are
shared along the tree exactly as on the fast path. Everything else (embeddings, RoPE of any kind,
norms, MLPs, mixture-of-experts blocks, logit processing) is the HF model's own code, unchanged.

The plug is transformers' attention-function interface: treegen registers :data:`ATTN_IMPLEMENTATION`
with ``AttentionInterface`` and sets the model's ``_attn_implementation`` to it. transformers builds
no mask for an attention function it has no mask function for, so each layer's attention module
hands :func:`tree_attention_interface` the new tokens' RoPE'd queries, keys and values and nothing
else; the model is called with ``position_ids`` from the tree and no HF cache.

Loading probes the model once (a two-token forward, :meth:`GenericModel._probe`): every layer must
call the attention function exactly once with keys and values of one shape (state-space, hybrid
recurrent or latent-attention layers are refused by name). Attention sinks (gpt-oss: a logit per head in
every softmax's denominator) rescale tree attention's output by ``sigmoid(lse - sink)``, each row's LSE from
``attend.lse`` (a second pass over the keys, PyTorch's). Each layer's sliding window and the attention soft cap are
read from the calls (``layer_window``, ``attn_softcap``) and applied by the runtime's tree-attention
plans, as for the fast path. On CUDA a second probe captures the forward as a CUDA
graph: modules that synchronise with the host (e.g. a mixture-of-experts block looping over the
experts it routed to, or dynamic RoPE) cannot be captured, and the model then says so
(``graphs_off_reason``) and the engine decodes without graphs.
"""

from __future__ import annotations

import contextvars
import logging

import torch
from torch import Tensor

from .model import AttendFn, eos_ids_of
from .model_config import UnsupportedModelError, effective_window

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "treegen_tree"

# model_types of state-space and hybrid recurrent models in transformers (their layers keep a
# recurrent state, not only keys and values): refused by name before any weights are read
RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba", "falcon_h1", "nemotron_h", "rwkv",
    "recurrent_gemma", "xlstm", "lfm2", "lfm2_moe", "granitemoehybrid", "qwen3_next", "qwen3_5", "qwen3_5_moe",
    "minimax", "plamo2", "kimi_linear", "olmo_hybrid",
})
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

# the attention call of the forward pass running now (see GenericModel.forward)
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("treegen_generic_attention", default=None)

GENERIC_SUPPORT = ("decoder-only causal LMs of transformers with softmax attention over keys and values "
                   "(dense or mixture-of-experts), run by their own modules")


def tree_attention_interface(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                             dropout: float = 0.0, **kwargs):
    """The attention function treegen registers with transformers: passes one layer's new tokens to the
    running :class:`GenericModel`. query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]`` → ``([1, T, H, D], None)``."""
    call = _CURRENT.get()
    if call is None:
        raise RuntimeError(f"this model's attention is treegen's ({ATTN_IMPLEMENTATION!r}): it runs only inside "
                           f"treegen's GenericModel.forward (load a separate copy of the model to use it on its own)")
    return call(module, query, key, value, attention_mask, scaling, kwargs)


def register_attention() -> None:
    """Register :func:`tree_attention_interface` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_interface)


def generic_refusal(config) -> str | None:
    """Why the generic path cannot run ``config`` (an HF config), or None when it can (as far as the
    config tells: loading probes the modules too). Cheap: no weights."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        return f"model_type={model_type!r} is an encoder-decoder model"
    if model_type in RECURRENT_MODEL_TYPES:
        return f"model_type={model_type!r} is a state-space or hybrid recurrent model"
    other = sorted(set(getattr(config, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES)
    if other:
        return f"model_type={model_type!r} has layers of type {other} (not softmax attention over a KV cache)"
    if any(getattr(config, name, None) is not None for name in ("vision_config", "audio_config", "text_config")):
        return f"model_type={model_type!r} is a multimodal model (treegen runs text-only decoders)"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"model_type={model_type!r} has no causal-LM class in transformers"
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        return f"model_type={model_type!r} attends bidirectionally (treegen decodes causally)"
    if getattr(config, "attention_chunk_size", None):
        return f"model_type={model_type!r} uses chunked attention"
    return None


def _rope_context_limit(config) -> int | None:
    """Dynamic RoPE types change their frequencies with the longest sequence in a batch: packed
    sequences stay exact only below the original context, where they are plain RoPE."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    nested = bool(params) and all(isinstance(p, dict) or p is None for p in params.values())
    flats = [p for p in params.values() if p] if nested else [params]
    limit = None
    for p in flats:
        if p.get("rope_type", p.get("type")) in ("dynamic", "longrope"):
            original = p.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)
            if original:
                limit = int(original) if limit is None else min(limit, int(original))
    return limit


class GenericModel:
    """An HF ``*ForCausalLM`` behind the runtime's model interface (see the module doc).

    Attributes as :class:`~treegen.runtime.model.LlamaFamilyModel`'s that the runtime reads:
    ``config``, ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``vocab_size``,
    ``dtype``, ``device``, ``eos_token_ids``, ``max_context``, ``attn_scale``; plus ``hf`` (the
    wrapped model), ``implementation`` (``"generic"``), ``reason`` (why this path runs it) and
    ``graphs_off_reason`` (None when its forward can be captured as a CUDA graph).
    """

    implementation = "generic"
    vocab_split = None  # (the LM head is never split by vocabulary on this path)

    def __init__(self, hf_model, *, eos_token_ids=frozenset(),
                 reason: str = "built from a transformers model directly") -> None:
        config = hf_model.config
        refusal = generic_refusal(config)
        if refusal is not None:
            raise UnsupportedModelError(f"{refusal}: not supported ({GENERIC_SUPPORT})")
        register_attention()
        if hasattr(hf_model, "set_attn_implementation"):
            hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
        else:
            config._attn_implementation = ATTN_IMPLEMENTATION
        self.hf = hf_model.eval()
        self.config = config
        self.reason = reason
        self.dtype = hf_model.dtype
        self.device = hf_model.device
        self.vocab_size = int(hf_model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = set(eos_token_ids) | eos_ids_of(config, getattr(hf_model, "generation_config", None))
        self._probe()
        if self.device.type != "cuda":
            self.graphs_off_reason = None
        elif self.needs_row_lse:  # (its LSE pass reads reference plans, which a kept graph's padded plan does not carry)
            self.graphs_off_reason = "attention sinks: each row's LSE is a PyTorch pass, not captured"
        else:
            self.graphs_off_reason = self._capture_probe()

    @classmethod
    def from_pretrained(cls, source: str, config, *, dtype: torch.dtype, device: torch.device,
                        reason: str = "", eos_token_ids=frozenset()) -> "GenericModel":
        """Load a checkpoint with ``AutoModelForCausalLM.from_pretrained`` (straight onto ``device``)."""
        from transformers import AutoModelForCausalLM

        register_attention()
        kwargs = {} if device.type == "cpu" else {"device_map": device}
        hf = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype,
                                                  attn_implementation=ATTN_IMPLEMENTATION, **kwargs)
        return cls(hf, eos_token_ids=eos_token_ids, reason=reason)

    # ------------------------------------------------------------------ probes

    def _probe(self) -> None:
        """Run two tokens through the model once and read the attention calls: which layers attend, with
        what head shapes, scale and window; refuse what tree attention cannot compute."""
        seen: dict[int, tuple] = {}

        def record(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return torch.zeros_like(q)

        record.lse = lambda layer, q: torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)

        def inspect(module, q, k, v, kwargs):
            layer = getattr(module, "layer_idx", None)
            if layer is None:
                raise UnsupportedModelError(f"model_type={self.config.model_type!r}: its attention module "
                                            f"{type(module).__name__} has no layer_idx")
            if layer in seen:
                raise UnsupportedModelError(f"model_type={self.config.model_type!r}: layer {layer} attends twice "
                                            f"in one forward pass (shared or cross-layer KV is not supported)")
            seen[layer] = (q.shape[1], k.shape[1], k.shape[3], tuple(v.shape), kwargs.get("sliding_window"),
                           kwargs.get("softcap"))
            sinks.add(kwargs.get("s_aux") is not None)

        sinks: set[bool] = set()
        self.attn_scale, self.max_context, self._scales = 1.0, 0, {}
        ids = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._forward(ids, torch.arange(2, device=self.device), record, None, inspect=inspect)
        name = self.config.model_type
        n = int(getattr(self.config, "num_hidden_layers", len(seen)))
        if not seen:
            raise UnsupportedModelError(
                f"model_type={name!r}: none of its {n} layers calls transformers' attention interface, which the "
                f"generic path plugs tree attention into (attention written into the model's own code, as "
                f"Falcon's, Bloom's or MPT's, or recurrent / state-space layers); the generic path runs {GENERIC_SUPPORT}")
        if sorted(seen) != list(range(n)):
            missing = sorted(set(range(n)) - set(seen))
            raise UnsupportedModelError(
                f"model_type={name!r}: layers {missing} of {n} do not use attention over keys and values "
                f"(recurrent or state-space layers?); the generic path runs {GENERIC_SUPPORT}")
        shapes = {(h, hkv, d) for h, hkv, d, *_ in seen.values()}
        if len(shapes) != 1:
            raise UnsupportedModelError(f"model_type={name!r}: layers differ in head shapes {sorted(shapes)}")
        (self.num_heads, self.num_kv_heads, self.head_dim), = shapes
        for layer, (_, hkv, d, v_shape, *_) in seen.items():
            if (v_shape[1], v_shape[3]) != (hkv, d):
                raise UnsupportedModelError(
                    f"model_type={name!r}: layer {layer}'s values have shape {tuple(v_shape)}, its keys "
                    f"[1, {hkv}, T, {d}] (keys and values of different sizes, e.g. latent attention, are not supported)")
        self.num_layers = n
        # attention sinks (gpt-oss): the runtime plans each pass for rows' LSEs too (PassPlan.lse_layer)
        self.needs_row_lse = True in sinks
        self.attn_scale = next(iter(self._scales.values()))
        caps = {seen[i][5] for i in range(n)}
        if len(caps) != 1:
            raise UnsupportedModelError(f"model_type={name!r}: layers differ in attention soft-capping {sorted(caps, key=str)}")
        cap = caps.pop()
        self.attn_softcap = None if cap is None else float(cap)
        limits = [int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)]
        rope_limit = _rope_context_limit(self.config)
        self.max_context = min(limits + ([rope_limit] if rope_limit else []))
        # what the runtime's plans apply per layer (tree attention computes both; see PassPlan in engine.py); the
        # windows the modules pass, to check that they do not change
        self._windows = [seen[i][4] for i in range(n)]
        self.layer_window = [effective_window(w, self.max_context) for w in self._windows]

    def _capture_probe(self) -> str | None:
        """None when a forward pass of this model can be captured as a CUDA graph, else why not."""
        from treegen.runtime.cuda_graph import capture

        ids = torch.zeros(2, dtype=torch.int64, device=self.device)
        pos = torch.arange(2, device=self.device)
        try:
            capture(lambda: self.forward(ids, pos, lambda layer, q, k, v: q))
        except Exception as err:  # noqa: BLE001 - any failure to capture means: run without graphs
            torch.cuda.synchronize(self.device)
            return f"its modules cannot be captured as a CUDA graph ({type(err).__name__}: {str(err).splitlines()[0][:160]})"
        return None

    # ------------------------------------------------------------------ forward

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, attend: AttendFn,
                logits_rows: Tensor | None = None, gather: bool = True, fp32_logits: bool = True) -> Tensor:
        """As :meth:`LlamaFamilyModel.forward`: packed tokens ``[T]`` at ``positions [T]``, ``attend``
        called once per layer with the new tokens' q ``[T, H, D]`` (RoPE'd) and k, v ``[T, Hkv, D]``;
        returns fp32 logits ``[R, vocab]`` of ``logits_rows`` (default: all rows; ``fp32_logits=False``:
        in the dtype the model computed them). ``gather``: ignored (this path never splits the
        vocabulary: ``vocab_split`` is None)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [T]; got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        logits = self._forward(input_ids, positions, attend, logits_rows)
        return logits.float() if fp32_logits else logits

    __call__ = forward

    def _forward(self, input_ids: Tensor, positions: Tensor, attend: AttendFn, logits_rows: Tensor | None,
                 inspect=None) -> Tensor:
        def attention(module, query, key, value, attention_mask, scaling, kwargs):
            if inspect is not None:
                inspect(module, query, key, value, kwargs)
            return self._attend_layer(attend, module, query, key, value, attention_mask, scaling, kwargs)

        token = _CURRENT.set(attention)
        try:
            out = self.hf(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                          logits_to_keep=0 if logits_rows is None else logits_rows)
        finally:
            _CURRENT.reset(token)
        logits = out.logits[0]
        if logits_rows is not None and logits.shape[0] != logits_rows.shape[0]:  # a model without logits_to_keep
            logits = logits.index_select(0, logits_rows)
        return logits

    def _attend_layer(self, attend: AttendFn, module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                      scaling, kwargs) -> tuple[Tensor, None]:
        """One layer: HF's ``[1, heads, T, D]`` tensors to the runtime's ``[T, heads, D]`` and back."""
        name = self.config.model_type
        sinks = kwargs.get("s_aux")  # gpt-oss: a logit per head in every softmax's denominator, with no value
        if sinks is not None and (sinks.dim() != 1 or sinks.numel() != query.shape[1]):
            raise UnsupportedModelError(f"model_type={name!r}: attention sinks of shape {tuple(sinks.shape)}; one "
                                        f"logit per head ({query.shape[1]}) is supported")
        cap, window = kwargs.get("softcap"), kwargs.get("sliding_window")
        if hasattr(self, "_windows") and ((None if cap is None else float(cap)) != self.attn_softcap
                                          or window != self._windows[module.layer_idx]):
            raise UnsupportedModelError(f"model_type={name!r}: layer {module.layer_idx} changed its window or soft "
                                        f"cap since loading ({window}, {cap})")
        if attention_mask is not None:
            raise UnsupportedModelError(f"model_type={name!r} builds its own attention mask "
                                        f"({type(attention_mask).__name__}); treegen's tree attention replaces it")
        if query.shape[0] != 1:
            raise ValueError(f"the generic path runs one packed batch row, got query {tuple(query.shape)}")
        head_dim = query.shape[-1]
        scale = float(scaling) if scaling is not None else head_dim**-0.5
        layer = module.layer_idx
        self._scales.setdefault(layer, scale)
        q = query[0].transpose(0, 1)
        if scale != self.attn_scale:  # attend scales by the model's one attn_scale: fold this layer's into q
            q = q * (scale / self.attn_scale)
        q = q.to(self.dtype).contiguous()
        k = key[0].transpose(0, 1).to(self.dtype)
        v = value[0].transpose(0, 1).to(self.dtype)
        out = attend(layer, q, k, v)
        if sinks is not None:  # softmax over the keys and a sink: the keys' attention times Z / (Z + e^sink)
            lse = attend.lse(layer, q)  # [T, H]: log Z of each row's visible keys
            out = (out.float() * torch.sigmoid(lse - sinks.float())[..., None]).to(out.dtype)
        return out.unsqueeze(0), None  # [1, T, H, D]

    def __repr__(self) -> str:
        graphs = "" if self.graphs_off_reason is None else ", cuda_graphs=off"
        return (f"GenericModel({self.config.model_type}: {type(self.hf).__name__}, layers={self.num_layers}, "
                f"heads={self.num_heads}/{self.num_kv_heads}x{self.head_dim}, vocab={self.vocab_size}, "
                f"dtype={self.dtype}, device={self.device}, max_context={self.max_context}{graphs})")


__all__ = ["ATTN_IMPLEMENTATION", "GENERIC_SUPPORT", "GenericModel", "RECURRENT_MODEL_TYPES", "generic_refusal",
           "register_attention", "tree_attention_interface"]
