"""What the planner may propose for a T5 (encoder-decoder) model: the rules `tessera pretrain`
applies to T5, read from `core.models.t5.layout` (the one place they live), never restated here.

`Layout.problems` already refuses context parallelism, virtual stages and pipeline sizes that
`t5_stage_split` cannot share out between encoder and decoder; this module adds the schedule and
precision rules (`T5_RECOMPUTE`, `T5_REFUSED_PRECISIONS`) and the search spaces that follow.
"""

from __future__ import annotations

from tessera.core.config import ModelConfig
from tessera.core.models.t5.layout import T5_RECOMPUTE, T5_REFUSED_PRECISIONS, t5_pipeline_sizes


def t5_job_problems(model: ModelConfig, precision: str) -> list[str]:
    """What a whole job asks of a T5 that T5 pretraining refuses."""
    if precision in T5_REFUSED_PRECISIONS:
        return [f"T5 does not train in {precision} (`tessera pretrain` refuses it: FP8 covers "
                "the decoder-only blocks); plan with --precision bf16 (or fp32 on CPUs)"]
    return []


def t5_mode_problems(model: ModelConfig, serve: bool = False, measure: bool = False
                     ) -> list[str]:
    """The planner's modes that do not model a T5 yet: serving (its KV cache and time per
    token are a decoder-only's) and `--measure` (its runs read token data without a tokenizer,
    which T5's sentinels need)."""
    out = []
    if serve:
        out.append("--serve plans decoder-only models; T5's encoder pass and cross-attention "
                   "cache are not modelled (plan its training without --serve)")
    if measure:
        out.append("--measure runs candidates on token data without a tokenizer, and T5 span "
                   "corruption needs one; plan T5 analytically (leave out --measure) and run "
                   "the --output config with tessera pretrain --tokenizer")
    return out


def t5_config_problems(model: ModelConfig, recompute: str) -> list[str]:
    """What one configuration's schedule asks of a T5 that T5 pretraining refuses."""
    if recompute not in T5_RECOMPUTE:
        return [f"T5 trains without activation recomputation (`tessera pretrain` refuses "
                f"recompute {recompute}); use recompute {T5_RECOMPUTE[0]}"]
    return []


def t5_search_space(model: ModelConfig) -> dict[str, list]:
    """The pipeline sizes, virtual stages, cp sizes and recompute modes worth enumerating for
    a T5 (`t5_pipeline_sizes`: every split `t5_stage_split` accepts; one stage per rank; no
    cp; no recomputation)."""
    return {"pp": t5_pipeline_sizes(model), "virtual_stages": [1], "cp": [1],
            "recompute": list(T5_RECOMPUTE)}
