"""Which module class builds one pipeline stage of a model family: `T5Model` for "t5",
`BertModel` for "bert", else the decoder-only `GPTModel`. For code that builds stages for any
family: `core.init.build_model`, and `converters.reshard.target_files` (on the meta device, to
learn names and shapes)."""

from __future__ import annotations

from torch import nn

from tessera.core.config import ModelConfig


def stage_class(config: ModelConfig) -> type[nn.Module]:
    """The class whose `(config, layout, groups, stage_id, num_stages)` builds one stage."""
    if config.family == "t5":
        from tessera.core.t5 import T5Model

        return T5Model
    if config.family == "bert":
        from tessera.core.bert import BertModel

        return BertModel
    from tessera.core.model import GPTModel

    return GPTModel
