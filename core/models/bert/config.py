"""What a `ModelConfig` of family "bert" must say, checked once in `ModelConfig.__post_init__`
(through the family's `problems`).

`core.models.bert.model.BertModel` computes one architecture (the original BERT of Devlin et al. 2018,
https://arxiv.org/abs/1810.04805): learned positions, token types, LayerNorm after each residual
add, GELU, a masked-LM head whose decoder is the word embedding. A field that asks for something
else (RoPE, RMSNorm, SwiGLU, an untied decoder) is an error that names it, never ignored.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessera.core.config import ModelConfig

BERT_TRAITS = MappingProxyType(dict(norm="layernorm", position="learned", tied_embeddings=True,
                                   bias=True))


def bert_problems(config: ModelConfig) -> list[str]:
    """Every field that a BERT model cannot honour, with the value BERT needs."""
    problems = [f"{k}={getattr(config, k)!r} (BERT needs {v!r})"
                for k, v in BERT_TRAITS.items() if getattr(config, k) != v]
    if config.activation not in ("gelu", "gelu_tanh"):
        problems.append(f"activation={config.activation!r} (BERT needs 'gelu' or 'gelu_tanh')")
    if config.options.type_vocab_size < 1:
        problems.append(f"options.type_vocab_size={config.options.type_vocab_size} (BERT needs "
                        f">= 1 segment)")
    return problems
