"""The Hugging Face <-> Tessera contract, as data plus small functions.

Config: `config_from_hf(config.json dict) -> ModelConfig` for model types gpt2, llama, mistral
(a Llama with an optional sliding window, accepted only when the window covers every position)
and nemotron (and those of `converters.hf_moe`, `hf_qwen3`, `hf_t5`, `hf_bert`);
`config_to_hf(ModelConfig) -> dict` is the inverse, a config.json that `transformers.AutoConfig`
reads. Anything the Tessera model cannot compute exactly (rope scaling,
a real sliding window, separate attention/MLP bias flags, other activations) is an error that
names the field, never a silent approximation.

Weights: one name map per family, Tessera global name -> the HF tensors it is made of, with `{}`
standing for the layer index. Several HF tensors are stacked along dim 0 in the order listed:
q/k/v into the fused `attention.wqkv`, gate/up into the fused SwiGLU `feed_forward.w1`; the split
sizes on the way back come from `sharding.shard_spec`, the one place that defines the fused
layouts. GPT-2 stores its linear layers as `Conv1D`, weight `(in, out)`: those are transposed.
Both directions are pure re-arrangements (cat, split, transpose), so HF -> Tessera -> HF gives
back bit-identical tensors, and both stream: `read(name)` is called once per tensor, when the
tensor is needed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tessera.converters.hf_bert import (
    BERT_IGNORED,
    BERT_NAMES,
    BERT_TRAITS,
    bert_config_from_hf,
    bert_config_to_hf,
)
from tessera.converters.hf_moe import (
    MOE_FAMILIES,
    check_moe_exportable,
    expand_experts,
    fused_overrides,
    has_fused_experts,
    mixtral_config,
    moe_config_to_hf,
    moe_name_maps,
    qwen2_moe_config,
)
from tessera.converters.hf_qwen3 import (
    QK_NORM_NAMES,
    qwen3_config,
    qwen3_config_to_hf,
    qwen3_moe_config,
)
from tessera.core.config import ModelConfig
from tessera.core.parallel.sharding import global_param_shapes, shard_spec

Read = Callable[[str], torch.Tensor]


class ConversionError(ValueError):
    """A model that cannot be converted as asked; the message names the field or tensor."""


_LLAMA_LIKE: dict[str, tuple[str, ...]] = {
    "tok_embeddings.weight": ("model.embed_tokens.weight",),
    "layers.{}.attention_norm.weight": ("model.layers.{}.input_layernorm.weight",),
    "layers.{}.attention_norm.bias": ("model.layers.{}.input_layernorm.bias",),
    "layers.{}.attention.wqkv.weight": ("model.layers.{}.self_attn.q_proj.weight",
                                        "model.layers.{}.self_attn.k_proj.weight",
                                        "model.layers.{}.self_attn.v_proj.weight"),
    "layers.{}.attention.wqkv.bias": ("model.layers.{}.self_attn.q_proj.bias",
                                      "model.layers.{}.self_attn.k_proj.bias",
                                      "model.layers.{}.self_attn.v_proj.bias"),
    "layers.{}.attention.wo.weight": ("model.layers.{}.self_attn.o_proj.weight",),
    "layers.{}.attention.wo.bias": ("model.layers.{}.self_attn.o_proj.bias",),
    "layers.{}.ffn_norm.weight": ("model.layers.{}.post_attention_layernorm.weight",),
    "layers.{}.ffn_norm.bias": ("model.layers.{}.post_attention_layernorm.bias",),
    "layers.{}.feed_forward.w2.weight": ("model.layers.{}.mlp.down_proj.weight",),
    "layers.{}.feed_forward.w2.bias": ("model.layers.{}.mlp.down_proj.bias",),
    "norm.weight": ("model.norm.weight",),
    "norm.bias": ("model.norm.bias",),
    "output.weight": ("lm_head.weight",),
}

# Tessera global name (with `{}` for the layer) -> HF tensor names, stacked along dim 0.
NAME_MAPS: dict[str, dict[str, tuple[str, ...]]] = {
    "gpt2": {
        "tok_embeddings.weight": ("transformer.wte.weight",),
        "pos_embeddings.weight": ("transformer.wpe.weight",),
        "layers.{}.attention_norm.weight": ("transformer.h.{}.ln_1.weight",),
        "layers.{}.attention_norm.bias": ("transformer.h.{}.ln_1.bias",),
        "layers.{}.attention.wqkv.weight": ("transformer.h.{}.attn.c_attn.weight",),
        "layers.{}.attention.wqkv.bias": ("transformer.h.{}.attn.c_attn.bias",),
        "layers.{}.attention.wo.weight": ("transformer.h.{}.attn.c_proj.weight",),
        "layers.{}.attention.wo.bias": ("transformer.h.{}.attn.c_proj.bias",),
        "layers.{}.ffn_norm.weight": ("transformer.h.{}.ln_2.weight",),
        "layers.{}.ffn_norm.bias": ("transformer.h.{}.ln_2.bias",),
        "layers.{}.feed_forward.w1.weight": ("transformer.h.{}.mlp.c_fc.weight",),
        "layers.{}.feed_forward.w1.bias": ("transformer.h.{}.mlp.c_fc.bias",),
        "layers.{}.feed_forward.w2.weight": ("transformer.h.{}.mlp.c_proj.weight",),
        "layers.{}.feed_forward.w2.bias": ("transformer.h.{}.mlp.c_proj.bias",),
        "norm.weight": ("transformer.ln_f.weight",),
        "norm.bias": ("transformer.ln_f.bias",),
        "output.weight": ("lm_head.weight",),
    },
    "llama": {
        **_LLAMA_LIKE,
        "layers.{}.feed_forward.w1.weight": ("model.layers.{}.mlp.gate_proj.weight",
                                             "model.layers.{}.mlp.up_proj.weight"),
        "layers.{}.feed_forward.w1.bias": ("model.layers.{}.mlp.gate_proj.bias",
                                           "model.layers.{}.mlp.up_proj.bias"),
    },
    "nemotron": {  # LayerNorm1P stores weight - 1 on both sides: copied as is
        **_LLAMA_LIKE,
        "layers.{}.feed_forward.w1.weight": ("model.layers.{}.mlp.up_proj.weight",),
        "layers.{}.feed_forward.w1.bias": ("model.layers.{}.mlp.up_proj.bias",),
    },
    "bert": BERT_NAMES,
}

NAME_MAPS.update(moe_name_maps(_LLAMA_LIKE))  # Mixture-of-Experts families (converters.hf_moe)
NAME_MAPS["qwen3"] = {**NAME_MAPS["llama"], **QK_NORM_NAMES}  # Qwen3 (converters.hf_qwen3)

# HF tensors stored `(in, out)` (GPT-2's Conv1D): transposed on the way in and out.
TRANSPOSED = frozenset(f"transformer.h.{{}}.{leaf}.weight"
                       for leaf in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))

# HF entries that are buffers, not weights: GPT-2's causal mask, cached RoPE frequencies.
IGNORED = re.compile(r"(\.attn\.(masked_)?bias|\.rotary_emb\.inv_freq)$" + BERT_IGNORED)

# Old checkpoints name tensors without the base-model prefix (`h.0.ln_1.weight`).
_BASE_PREFIXES = ("transformer.", "model.")

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


# ---------------------------------------------------------------------------------- config


def _rope(hf: dict[str, Any], default_fraction: float) -> tuple[float, float]:
    """(rope_theta, partial rotary fraction) from transformers v5 `rope_parameters` or the
    older top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling` fields."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ConversionError(f"rope scaling type {kind!r} is not supported (only plain RoPE); "
                              "the Tessera model has no scaled rotary embedding")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor",
                                                          default_fraction))
    return float(theta), float(fraction)


def _require(hf: dict[str, Any], key: str, allowed: tuple[Any, ...], default: Any) -> Any:
    value = hf.get(key, default)
    if value not in allowed:
        raise ConversionError(f"{hf.get('model_type')} config: {key}={value!r} is not supported "
                              f"(supported: {', '.join(map(repr, allowed))})")
    return value


def _gpt2_config(hf: dict[str, Any]) -> ModelConfig:
    act = _require(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu"), "gelu_new")
    _require(hf, "scale_attn_weights", (True,), True)
    _require(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
    _require(hf, "add_cross_attention", (False,), False)
    hidden = hf["n_embd"]
    return ModelConfig(
        name="gpt2", family="gpt2", vocab_size=hf["vocab_size"], hidden_size=hidden,
        num_layers=hf["n_layer"], num_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
        max_position_embeddings=hf["n_positions"], norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation="gelu" if act == "gelu" else "gelu_tanh", position="learned", bias=True,
        tied_embeddings=hf.get("tie_word_embeddings", True), dropout=hf.get("resid_pdrop", 0.0),
        init_std=hf.get("initializer_range", 0.02))


def _llama_like_fields(hf: dict[str, Any], default_fraction: float) -> dict[str, Any]:
    attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ConversionError(
            f"{hf['model_type']} config: attention_bias={attention_bias} but mlp_bias={mlp_bias}; "
            "Tessera has one `bias` flag for every linear layer, so both must be equal")
    theta, fraction = _rope(hf, default_fraction)
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"), ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"], position="rope",
        rope_theta=theta, rotary_fraction=fraction, bias=bool(attention_bias),
        tied_embeddings=hf.get("tie_word_embeddings", False),
        dropout=hf.get("attention_dropout", 0.0), init_std=hf.get("initializer_range", 0.02))


def _llama_config(hf: dict[str, Any]) -> ModelConfig:
    _require(hf, "hidden_act", ("silu",), "silu")
    window = hf.get("sliding_window")  # Mistral: a window covering every position is no window
    if window is not None and window < hf["max_position_embeddings"]:
        raise ConversionError(
            f"{hf['model_type']} config: sliding_window={window} is smaller than "
            f"max_position_embeddings={hf['max_position_embeddings']}; Tessera attends to the "
            "whole causal context, so sliding-window attention cannot be converted exactly")
    fields = _llama_like_fields(hf, 1.0)
    if fields["rotary_fraction"] != 1.0:
        raise ConversionError(f"{hf['model_type']} config: partial_rotary_factor="
                              f"{fields['rotary_fraction']} is not supported for Llama models")
    return ModelConfig(name=hf["model_type"], family="llama", norm="rmsnorm",
                       norm_eps=hf.get("rms_norm_eps", 1e-6), activation="swiglu", **fields)


def _nemotron_config(hf: dict[str, Any]) -> ModelConfig:
    _require(hf, "hidden_act", ("relu2",), "relu2")
    return ModelConfig(name="nemotron", family="nemotron", norm="layernorm1p",
                       norm_eps=hf.get("norm_eps", 1e-5), activation="squared_relu",
                       **_llama_like_fields(hf, 0.5))  # 0.5: transformers' default for Nemotron


def _t5_config(hf: dict[str, Any]) -> ModelConfig:  # T5: converters.hf_t5
    from tessera.converters.hf_t5 import t5_config_from_hf

    return t5_config_from_hf(hf)


_FROM_HF: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    "gpt2": _gpt2_config, "llama": _llama_config, "mistral": _llama_config,
    "nemotron": _nemotron_config, "t5": _t5_config, "bert": bert_config_from_hf,
    "mixtral": mixtral_config, "qwen2_moe": qwen2_moe_config,
    "qwen3": qwen3_config, "qwen3_moe": qwen3_moe_config,  # converters.hf_qwen3
}
SUPPORTED_MODEL_TYPES = tuple(_FROM_HF)


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """The Tessera `ModelConfig` of a Hugging Face `config.json` (as a dict).

    Raises:
        ConversionError: an unsupported model type, or a feature Tessera cannot compute exactly.
    """
    model_type = hf_config.get("model_type")
    if model_type not in _FROM_HF:
        arch = ", ".join(hf_config.get("architectures") or []) or "unknown architecture"
        raise ConversionError(f"model_type {model_type!r} ({arch}) is not supported; supported "
                              f"model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        return _FROM_HF[model_type](hf_config)
    except KeyError as exc:
        raise ConversionError(f"{model_type} config lacks the field {exc.args[0]!r}") from None


# What each family's HF model computes; a ModelConfig that differs has no HF equivalent.
_FAMILY_TRAITS: dict[str, dict[str, Any]] = {
    "gpt2": dict(norm="layernorm", position="learned", bias=True),
    "llama": dict(norm="rmsnorm", activation="swiglu", position="rope", rotary_fraction=1.0),
    "nemotron": dict(norm="layernorm1p", activation="squared_relu", position="rope"),
    "bert": BERT_TRAITS,
    "qwen3": dict(norm="rmsnorm", activation="swiglu", position="rope", rotary_fraction=1.0,
                  bias=False, qk_norm=True),  # converters.hf_qwen3
}


def _check_exportable(config: ModelConfig) -> None:
    if config.family == "t5":  # converters.hf_t5
        from tessera.converters.hf_t5 import check_t5_exportable

        return check_t5_exportable(config)
    if config.family in MOE_FAMILIES:  # Mixture-of-Experts (converters.hf_moe)
        problems = check_moe_exportable(config)
        if problems:
            raise ConversionError(f"this {config.family} model cannot be written as a Hugging "
                                  f"Face {config.family} model: {'; '.join(problems)}")
        return
    if config.family not in _FAMILY_TRAITS:
        raise ConversionError(f"family {config.family!r} has no Hugging Face mapping; "
                              f"known: {', '.join(_FAMILY_TRAITS)}")
    clash = {k: getattr(config, k) for k, v in _FAMILY_TRAITS[config.family].items()
             if getattr(config, k) != v}
    if config.family == "gpt2":
        if config.activation not in ("gelu", "gelu_tanh"):
            clash["activation"] = config.activation
        if config.num_kv_heads != config.num_heads or config.head_dim * config.num_heads != (
                config.hidden_size):
            clash["num_kv_heads/head_dim"] = (config.num_kv_heads, config.head_dim)
    if clash:
        raise ConversionError(f"this {config.family} model cannot be written as a Hugging Face "
                              f"{config.family} model: {clash} differ from what it computes "
                              f"({_FAMILY_TRAITS[config.family]})")


def config_to_hf(config: ModelConfig, *, dtype: str = "float32",
                 bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None) -> dict[str, Any]:
    """The `config.json` contents of `config` for transformers (v5, and v4 via legacy keys)."""
    if config.family == "t5":  # converters.hf_t5
        from tessera.converters.hf_t5 import t5_config_to_hf

        return t5_config_to_hf(config, dtype=dtype, bos_token_id=bos_token_id,
                               eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    _check_exportable(config)
    c = config
    out: dict[str, Any]
    if c.family == "bert":
        out = bert_config_to_hf(c)
    elif c.family in MOE_FAMILIES:  # Mixture-of-Experts (converters.hf_moe)
        out = moe_config_to_hf(c)
    elif c.family == "qwen3":  # converters.hf_qwen3
        out = qwen3_config_to_hf(c)
    elif c.family == "gpt2":
        out = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=c.vocab_size,
                   n_embd=c.hidden_size, n_layer=c.num_layers, n_head=c.num_heads,
                   n_inner=None if c.ffn_hidden_size == 4 * c.hidden_size else c.ffn_hidden_size,
                   n_positions=c.max_position_embeddings, layer_norm_epsilon=c.norm_eps,
                   activation_function="gelu" if c.activation == "gelu" else "gelu_new",
                   resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout)
    else:
        llama = c.family == "llama"
        rope = {"rope_type": "default", "rope_theta": c.rope_theta}
        if not llama:
            rope["partial_rotary_factor"] = c.rotary_fraction
        out = dict(architectures=["LlamaForCausalLM" if llama else "NemotronForCausalLM"],
                   model_type=c.family, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                   intermediate_size=c.ffn_hidden_size, num_hidden_layers=c.num_layers,
                   num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                   head_dim=c.head_dim, hidden_act="silu" if llama else "relu2",
                   max_position_embeddings=c.max_position_embeddings,
                   attention_bias=c.bias, mlp_bias=c.bias, attention_dropout=c.dropout,
                   rope_parameters=rope, **{k: v for k, v in rope.items() if k != "rope_type"})
        out["rms_norm_eps" if llama else "norm_eps"] = c.norm_eps  # top-level keys: for v4
    out.update(initializer_range=c.init_std, tie_word_embeddings=c.tied_embeddings,
               bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
               dtype=dtype, torch_dtype=dtype)  # `dtype` is v5's name, `torch_dtype` v4's
    return out


# --------------------------------------------------------------------------------- tensors


def _pattern(name: str) -> tuple[str, str]:
    """(name with `{}` for the layer index, the layer index or "")."""
    m = _LAYER.match(name)
    return (f"layers.{{}}.{m.group(2)}", m.group(1)) if m else (name, "")


def tensor_pairs(config: ModelConfig, fused_experts: bool = False
                 ) -> Iterator[tuple[str, list[tuple[str, bool]]]]:
    """(Tessera global name, [(HF name, transposed?), ...]) in `global_param_shapes` order.

    MoE experts (`converters.hf_moe`) are listed expert by expert, or with `fused_experts` as
    the fused `experts.gate_up_proj` / `experts.down_proj` tensors."""
    if config.family == "t5":  # converters.hf_t5
        from tessera.converters.hf_t5 import t5_tensor_pairs

        yield from t5_tensor_pairs(config)
        return
    names = NAME_MAPS[config.family]
    if fused_experts:
        names = {**names, **fused_overrides(config.family)}
    for name in global_param_shapes(config):
        pattern, layer = _pattern(name)
        if pattern not in names:
            raise ConversionError(f"no Hugging Face name for {name} in the {config.family} map")
        hf_names = expand_experts(names[pattern], config.num_experts)
        yield name, [(p.format(layer), p in TRANSPOSED) for p in hf_names]


def _resolve(hf_name: str, hf_names: set[str]) -> str | None:
    if hf_name in hf_names:
        return hf_name
    for prefix in _BASE_PREFIXES:
        if hf_name.startswith(prefix) and hf_name[len(prefix):] in hf_names:
            return hf_name[len(prefix):]
    return None


def import_tensors(config: ModelConfig, read: Read,
                   hf_names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(Tessera global name, tensor)` in `global_param_shapes` order from HF tensors.

    Every name is checked before the first tensor is read: a missing HF tensor, or one this
    map does not know (other than buffers such as GPT-2's `attn.bias`), raises ConversionError.
    Names without the base-model prefix (old GPT-2 files: `h.0.ln_1.weight`) are accepted.
    """
    plan: list[tuple[str, list[tuple[str, bool]]]] = []
    used: set[str] = set()
    for name, sources in tensor_pairs(config, has_fused_experts(hf_names)):
        resolved = []
        for hf_name, transposed in sources:
            found = _resolve(hf_name, hf_names)
            if found is None:
                raise ConversionError(f"the Hugging Face weights lack {hf_name} (needed for "
                                      f"Tessera's {name})")
            resolved.append((found, transposed))
            used.add(found)
        plan.append((name, resolved))
    tied_head = {"lm_head.weight"} if config.tied_embeddings else set()  # a stored tied copy
    if config.family == "t5":  # converters.hf_t5
        from tessera.converters.hf_t5 import t5_unread

        tied_head = t5_unread(config)
    unknown = sorted(n for n in hf_names - used - tied_head if not IGNORED.search(n))
    if unknown:
        raise ConversionError(f"the Hugging Face weights hold tensors the {config.family} map "
                              f"does not know: {unknown[:6]}; refusing a partial conversion")
    shapes = global_param_shapes(config)
    for name, sources in plan:
        parts = [read(n).t().contiguous() if transposed else read(n) for n, transposed in sources]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if len(shapes[name]) == 3 and tensor.dim() == 2:  # MoE experts, one after the other
            tensor = tensor.reshape(-1, *shapes[name][1:])
        if tuple(tensor.shape) != shapes[name]:
            raise ConversionError(f"{[n for n, _ in sources]} give shape {tuple(tensor.shape)} "
                                  f"for {name}; the config implies {shapes[name]}")
        yield name, tensor


def export_tensors(config: ModelConfig, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(HF name, tensor)` from Tessera global tensors `read(name)`; the inverse of
    `import_tensors`. `lm_head.weight` is absent when the embeddings are tied, as transformers
    expects. Tensors may be views of the one read; they are contiguous."""
    _check_exportable(config)
    for name, targets in tensor_pairs(config):
        yield from hf_parts(config, name, read(name), targets)


def hf_parts(config: ModelConfig, name: str, tensor: torch.Tensor,
             targets: list[tuple[str, bool]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`(HF name, tensor)` of each HF tensor the Tessera global `tensor` `name` is made of
    (`targets` from `tensor_pairs`): fused blocks split, Conv1D weights transposed."""
    parts = (tensor,)
    if tensor.dim() == 3 and len(targets) > 1:  # MoE experts: equal blocks, expert by expert
        parts = tensor.reshape(-1, tensor.shape[-1]).chunk(len(targets), dim=0)
    elif len(targets) > 1:  # fused blocks: their sizes live in the sharding rules
        parts = tensor.split(list(shard_spec(name, config).parts), dim=0)
    for (hf_name, transposed), part in zip(targets, parts, strict=True):
        yield hf_name, part.t().contiguous() if transposed else part.contiguous()
