"""Our own decoder forward pass for Llama-family checkpoints (llama, mistral, qwen2).

The model owns the weights and the maths of one decoder step; it owns nothing
about the KV cache.  Every layer hands the new tokens' (RoPE'd) queries, keys
and values to a caller-supplied ``attend`` callback, which stores keys/values
wherever it likes and returns the attention output.  Tokens of many sequences
are packed in one flat ``[T]`` dimension; the only Python loop is over layers.

Numerics follow transformers' ``LlamaForCausalLM`` (RMSNorm in fp32, RoPE
cos/sin computed in fp32 then cast to the model dtype, logits from the lm_head
in the model dtype then cast to fp32), so fp32 logits match HF to ~1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from treegen.kernels.fused_ops import (add_rms_norm, fused_ops_available, rms_norm_reference, rope_,
                                       rope_reference, silu_mul)

rms_norm = rms_norm_reference

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# attend(layer_idx, q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim],
#        v [T, num_kv_heads, head_dim]) -> [T, num_heads, head_dim]
AttendFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (or one of its options) is not supported."""


class ModelNotFoundError(ValueError):
    """The model id / path could not be resolved to a checkpoint."""


# --------------------------------------------------------------------------- config checks


def _rope_parameters(config) -> dict:
    """RoPE settings as one flat dict (transformers 5 ``rope_parameters``, or legacy ``rope_scaling``)."""
    rp = getattr(config, "rope_parameters", None)
    if rp is None:
        rp = getattr(config, "rope_scaling", None)
    rp = dict(rp or {})
    if rp and all(isinstance(v, dict) for v in rp.values()):
        raise UnsupportedModelError(
            f"per-layer-type RoPE parameters are not supported (got keys {sorted(rp)})"
        )
    rp.setdefault("rope_type", rp.get("type", "default"))
    if "rope_theta" not in rp:
        rp["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return rp


def _rope_init_functions() -> dict:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS


def check_model_type(model_type: str | None) -> None:
    """Raise :class:`UnsupportedModelError` unless ``model_type`` is llama / mistral / qwen2."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model architecture model_type={model_type!r}; "
            f"treegen supports Llama-family checkpoints with model_type in {list(SUPPORTED_MODEL_TYPES)}"
        )


def check_supported(config) -> None:
    """Raise :class:`UnsupportedModelError` unless ``config`` (an HF config) is one we can run.

    Cheap: looks at the config only, so it can run before any weights are loaded.
    """
    model_type = getattr(config, "model_type", None)
    check_model_type(model_type)
    rope_type = _rope_parameters(config)["rope_type"]
    if rope_type != "default" and rope_type not in _rope_init_functions():
        raise UnsupportedModelError(
            f"unsupported RoPE type {rope_type!r} for model_type={model_type!r}; "
            f"supported: {['default', *sorted(_rope_init_functions())]}"
        )


def max_context_of(config) -> int:
    """Longest sequence (in tokens) this model can run with plain causal attention.

    ``max_position_embeddings``, further limited by a sliding window (which we do not
    implement: sequences up to the window are exactly full causal attention) and, for
    ``longrope``, by the original context (beyond it HF switches frequency sets).
    ``dynamic`` NTK RoPE equals plain RoPE for sequences up to ``max_position_embeddings``.
    """
    limit = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    if window is not None:
        layer_types = getattr(config, "layer_types", None)
        if config.model_type == "mistral":
            used = True
        elif layer_types is not None:
            used = "sliding_attention" in layer_types
        else:
            used = bool(getattr(config, "use_sliding_window", False))
        if used:
            limit = min(limit, int(window))
    rp = _rope_parameters(config)
    if rp["rope_type"] == "longrope" and rp.get("original_max_position_embeddings"):
        limit = min(limit, int(rp["original_max_position_embeddings"]))
    return limit


# --------------------------------------------------------------------------- building blocks


def rope_inv_freq(config) -> tuple[Tensor, float]:
    """(inv_freq [head_dim // 2] fp32 on CPU, attention_scaling) exactly as transformers computes them."""
    rp = _rope_parameters(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rp["rope_type"] == "default":
        base = rp["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    inv_freq, scaling = _rope_init_functions()[rp["rope_type"]](config, torch.device("cpu"))
    if inv_freq.numel() * 2 != head_dim:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    return inv_freq.to(torch.float32), float(scaling)


@dataclass
class _Layer:
    """Weights of one decoder layer (plain tensors; biases may be None).

    The q/k/v and gate/up projections are also kept fused (``qkv_w``, ``gate_up_w``: one matrix
    product each per step instead of three / two); the separate weights are views into them.
    """

    attn_norm: Tensor  # [hidden]
    q_w: Tensor  # [num_heads * head_dim, hidden]
    q_b: Tensor | None
    k_w: Tensor  # [num_kv_heads * head_dim, hidden]
    k_b: Tensor | None
    v_w: Tensor  # [num_kv_heads * head_dim, hidden]
    v_b: Tensor | None
    o_w: Tensor  # [hidden, num_heads * head_dim]
    o_b: Tensor | None
    mlp_norm: Tensor  # [hidden]
    gate_w: Tensor  # [intermediate, hidden]
    gate_b: Tensor | None
    up_w: Tensor  # [intermediate, hidden]
    up_b: Tensor | None
    down_w: Tensor  # [hidden, intermediate]
    down_b: Tensor | None
    qkv_w: Tensor | None = None  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_b: Tensor | None = None
    gate_up_w: Tensor | None = None  # [2 * intermediate, hidden]
    gate_up_b: Tensor | None = None

    def __post_init__(self) -> None:
        self.qkv_w, self.qkv_b = _fuse(self, ("q_w", "k_w", "v_w"), ("q_b", "k_b", "v_b"))
        self.gate_up_w, self.gate_up_b = _fuse(self, ("gate_w", "up_w"), ("gate_b", "up_b"))


def _fuse(layer: _Layer, weights: tuple[str, ...], biases: tuple[str, ...]) -> tuple[Tensor, Tensor | None]:
    """Concatenate ``layer``'s weights (and biases, zero where one is missing) along the output axis
    and make the separate ones views of the result, so the memory is held once."""
    parts = [getattr(layer, n) for n in weights]
    fused = torch.cat(parts)
    sizes = [p.shape[0] for p in parts]
    for name, view in zip(weights, fused.split(sizes)):
        setattr(layer, name, view)
    if all(getattr(layer, n) is None for n in biases):
        return fused, None
    fused_b = torch.cat([getattr(layer, n) if getattr(layer, n) is not None else fused.new_zeros(k)
                         for n, k in zip(biases, sizes)])
    for name, view in zip(biases, fused_b.split(sizes)):
        if getattr(layer, name) is not None:
            setattr(layer, name, view)
    return fused, fused_b


# --------------------------------------------------------------------------- the model


class LlamaFamilyModel:
    """Decoder-only Llama-family model with a cache-agnostic, packed-token forward.

    Attributes: ``config`` (HF config), ``num_layers``, ``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``hidden_size``, ``vocab_size``, ``dtype``, ``device``,
    ``eos_token_ids`` (set[int]), ``max_context`` (int, see :func:`max_context_of`),
    ``attn_scale`` (softmax scale ``head_dim ** -0.5`` that ``attend`` must use).
    """

    def __init__(self, config, embed: Tensor, layers: list[_Layer], norm: Tensor,
                 lm_head: Tensor, eos_token_ids: set[int]):
        check_supported(config)
        self.config = config
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm  # [hidden]
        self.lm_head = lm_head  # [vocab, hidden] (may be the same tensor as embed)
        self.eos_token_ids = set(eos_token_ids)

        self.num_layers = len(layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(lm_head.shape[0])
        self.dtype = embed.dtype
        self.device = embed.device
        self.eps = float(config.rms_norm_eps)
        self.attn_scale = self.head_dim**-0.5
        self.max_context = max_context_of(config)

        from transformers.activations import ACT2FN

        self.act = ACT2FN[config.hidden_act]
        self.intermediate_size = int(layers[0].gate_w.shape[0]) if layers else 0
        # on CUDA the element-wise steps run as fused Triton kernels (see treegen/kernels/fused_ops.py)
        self.fused = fused_ops_available(self.device) and config.hidden_act == "silu"
        inv_freq, self.rope_scaling = rope_inv_freq(config)
        self.inv_freq = inv_freq.to(self.device)  # [head_dim // 2] fp32

    @classmethod
    def from_hf(cls, hf_model, *, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None) -> "LlamaFamilyModel":
        """Wrap the weights of an HF ``*ForCausalLM`` (llama / mistral / qwen2).

        Tensors are shared with ``hf_model`` when device and dtype already match
        (no copy); drop ``hf_model`` afterwards to free its module wrappers.
        """
        config = hf_model.config
        check_supported(config)

        def t(p: Tensor | None) -> Tensor | None:
            return None if p is None else p.detach().to(device=device, dtype=dtype)

        def lin(mod) -> tuple[Tensor, Tensor | None]:
            return t(mod.weight), t(getattr(mod, "bias", None))

        layers = []
        for blk in hf_model.model.layers:
            att, mlp = blk.self_attn, blk.mlp
            layers.append(_Layer(
                t(blk.input_layernorm.weight), *lin(att.q_proj), *lin(att.k_proj), *lin(att.v_proj),
                *lin(att.o_proj), t(blk.post_attention_layernorm.weight), *lin(mlp.gate_proj),
                *lin(mlp.up_proj), *lin(mlp.down_proj),
            ))
        in_w = hf_model.get_input_embeddings().weight
        out_w = hf_model.get_output_embeddings().weight
        embed = t(in_w)
        lm_head = embed if out_w is in_w or out_w.data_ptr() == in_w.data_ptr() else t(out_w)
        if getattr(hf_model.get_output_embeddings(), "bias", None) is not None:
            raise UnsupportedModelError("lm_head with a bias is not supported")

        eos: set[int] = set()
        for src in (config, getattr(hf_model, "generation_config", None)):
            ids = getattr(src, "eos_token_id", None) if src is not None else None
            if ids is not None:
                eos.update([ids] if isinstance(ids, int) else ids)
        return cls(config, embed, layers, t(hf_model.model.norm.weight), lm_head, eos)

    @classmethod
    def random(cls, config, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
               seed: int = 0, std: float = 0.02) -> "LlamaFamilyModel":
        """Random weights of a config's real shapes, made directly on ``device`` (benchmarks: speed
        does not depend on the weights). Norm weights are 1; biases exist where the config asks."""
        check_supported(config)
        gen = torch.Generator(device=device).manual_seed(seed)
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        hd = getattr(config, "head_dim", None) or config.hidden_size // heads
        hidden, inter = config.hidden_size, config.intermediate_size
        qkv_bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        mlp_bias = bool(getattr(config, "mlp_bias", False))

        def w(*shape):
            return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

        def b(n, on):
            return w(n) if on else None

        ones = torch.ones(hidden, device=device, dtype=dtype)
        layers = [
            _Layer(ones, w(heads * hd, hidden), b(heads * hd, qkv_bias), w(kv * hd, hidden), b(kv * hd, qkv_bias),
                   w(kv * hd, hidden), b(kv * hd, qkv_bias), w(hidden, heads * hd),
                   b(hidden, bool(getattr(config, "attention_bias", False))), ones, w(inter, hidden),
                   b(inter, mlp_bias), w(inter, hidden), b(inter, mlp_bias), w(hidden, inter), b(hidden, mlp_bias))
            for _ in range(config.num_hidden_layers)
        ]
        embed = w(config.vocab_size, hidden)
        lm_head = embed if getattr(config, "tie_word_embeddings", False) else w(config.vocab_size, hidden)
        eos = getattr(config, "eos_token_id", None)
        eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        return cls(config, embed, layers, ones, lm_head, eos_ids)

    # ------------------------------------------------------------------ forward

    def rope_cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [T] int64 -> (cos, sin) each [T, 1, head_dim] in the model dtype (HF maths)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, head_dim // 2] fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.rope_scaling
        sin = emb.sin() * self.rope_scaling
        return cos.to(self.dtype)[:, None, :], sin.to(self.dtype)[:, None, :]

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, attend: AttendFn,
                logits_rows: Tensor | None = None) -> Tensor:
        """Run all layers over packed tokens and return fp32 logits.

        input_ids [T] int64: flat tokens of many sequences.
        positions [T] int64: absolute position of each token within its own sequence.
        attend(layer_idx, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]:
            q/k are after RoPE; k/v are only the new tokens' keys/values -- the caller
            caches them and computes attention (softmax scale ``self.attn_scale``).
            If ``attend.cache(layer_idx)`` exists and returns ``(k_cache, v_cache, slots)``, the
            fused CUDA path writes the keys/values there itself and calls ``attend(i, q, None, None)``.
        logits_rows [R] int64 (optional): rows of T whose logits are wanted (default: all).
        Returns [R, vocab] float32.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [T]; got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        n_tok, nh, nkv, hd = input_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        fused, inter = self.fused, self.intermediate_size
        cache = getattr(attend, "cache", None)
        cos, sin = self.rope_cos_sin(positions)  # [T, 1, D]
        h = F.embedding(input_ids, self.embed)  # [T, hidden]
        y = None  # the output of the previous sub-layer, not yet added to the residual stream h
        for i, L in enumerate(self.layers):
            h, x = self._add_norm(h, y, L.attn_norm)
            qkv = F.linear(x, L.qkv_w, L.qkv_b).view(n_tok, nh + 2 * nkv, hd)
            if fused and cache is not None:  # RoPE and the KV cache write in one kernel
                rope_(qkv, cos[:, 0], sin[:, 0], nh, nkv, store=cache(i))
                o = attend(i, qkv[:, :nh], None, None)
            else:
                if fused:
                    rope_(qkv, cos[:, 0], sin[:, 0], nh, nkv)
                    q, k = qkv[:, :nh], qkv[:, nh : nh + nkv]
                else:
                    q, k = rope_reference(qkv[:, :nh], cos, sin), rope_reference(qkv[:, nh : nh + nkv], cos, sin)
                o = attend(i, q, k, qkv[:, nh + nkv :])  # [T, H, D]
            y = F.linear(o.reshape(n_tok, nh * hd), L.o_w, L.o_b)
            h, x = self._add_norm(h, y, L.mlp_norm)
            gate_up = F.linear(x, L.gate_up_w, L.gate_up_b)
            gated = silu_mul(gate_up) if fused else self.act(gate_up[:, :inter]) * gate_up[:, inter:]
            y = F.linear(gated, L.down_w, L.down_b)
        if y is not None:
            h = h + y
        if logits_rows is not None:
            h = h.index_select(0, logits_rows)  # [R, hidden]
        h = rms_norm(h, self.norm, self.eps)
        return F.linear(h, self.lm_head).float()  # [R, vocab]

    def _add_norm(self, h: Tensor, y: Tensor | None, weight: Tensor) -> tuple[Tensor, Tensor]:
        """The residual add ``h + y`` (nothing when ``y`` is None) and its RMSNorm: (h, normed)."""
        if self.fused:  # one kernel; adds into h in place
            return h, add_rms_norm(h, y, weight, self.eps)
        h = h if y is None else h + y
        return h, rms_norm(h, weight, self.eps)

    __call__ = forward

    def __repr__(self) -> str:
        return (f"LlamaFamilyModel({self.config.model_type}, layers={self.num_layers}, "
                f"heads={self.num_heads}/{self.num_kv_heads}x{self.head_dim}, hidden={self.hidden_size}, "
                f"vocab={self.vocab_size}, dtype={self.dtype}, device={self.device}, "
                f"max_context={self.max_context})")


__all__ = [
    "AttendFn", "LlamaFamilyModel", "ModelNotFoundError", "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError", "check_model_type", "check_supported", "max_context_of", "rms_norm", "rope_inv_freq",
]
