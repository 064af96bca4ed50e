"""The Hugging Face <-> Tessera contract of `GPT2LMHeadModel`.

GPT-2 stores its linear layers as `Conv1D`, weight `(in, out)`: those are transposed on the way
in and out (and PEFT needs `fan_in_fan_out`); the FP8 loaders do not quantize them. Its fused
`c_attn` is Tessera's `attention.wqkv` as it is. Activations other than the GELUs, and the
attention-scaling options Tessera does not compute, are errors that name the field.
"""

from __future__ import annotations

from typing import Any

from tessera.converters.hf.family import HfFamily, check_traits, require, with_shared_fields
from tessera.core.config import ModelConfig

_NAMES = {
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
}

# The Conv1D weights, stored `(in, out)`.
_TRANSPOSED = frozenset(f"transformer.h.{{}}.{leaf}.weight"
                        for leaf in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))

# The causal-mask buffers older files store.
_BUFFERS = r"\.attn\.(masked_)?bias$"



def _config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    act = require(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu"), "gelu_new")
    require(hf, "scale_attn_weights", (True,), True)
    require(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
    require(hf, "add_cross_attention", (False,), False)
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


def _check_exportable(c: ModelConfig) -> None:
    clash: dict[str, Any] = {}
    if c.activation not in ("gelu", "gelu_tanh"):
        clash["activation"] = c.activation
    if c.num_kv_heads != c.num_heads or c.head_dim * c.num_heads != c.hidden_size:
        clash["num_kv_heads/head_dim"] = (c.num_kv_heads, c.head_dim)
    check_traits(c, clash)


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    fields = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=c.vocab_size,
                  n_embd=c.hidden_size, n_layer=c.num_layers, n_head=c.num_heads,
                  n_inner=None if c.ffn_hidden_size == 4 * c.hidden_size else c.ffn_hidden_size,
                  n_positions=c.max_position_embeddings, layer_norm_epsilon=c.norm_eps,
                  activation_function="gelu" if c.activation == "gelu" else "gelu_new",
                  resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout)
    return with_shared_fields(fields, c, **shared)


GPT2 = HfFamily(
    family="gpt2", config_from_hf=_config_from_hf, check_exportable=_check_exportable,
    config_to_hf=_config_to_hf, name_map=_NAMES, transposed=_TRANSPOSED, ignored=_BUFFERS,
    fan_in_fan_out=True,
    fp8_refusal="GPT-2 stores its linear layers as Conv1D, which the FP8 loaders of "
                "transformers and vLLM do not quantize")
