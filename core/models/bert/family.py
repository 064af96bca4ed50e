"""The BERT family's registry entry (`core.models.registry`)."""

from __future__ import annotations

from tessera.core.models.bert.config import BERT_TRAITS, bert_problems
from tessera.core.models.bert.options import BertOptions
from tessera.core.models.family import Family, Lazy

_HERE = "tessera.core.models.bert"

BERT = Family(
    name="bert",
    stage_class=Lazy(f"{_HERE}.model:BertModel"),
    param_shapes=Lazy(f"{_HERE}.sharding:bert_param_shapes"),
    shard_spec=Lazy(f"{_HERE}.sharding:bert_shard_spec"),
    init_tensor=Lazy("tessera.core.models.decoder.init:init_decoder_tensor"),
    problems=bert_problems,
    objective="masked-lm",
    traits=BERT_TRAITS,
    options=BertOptions,
)
