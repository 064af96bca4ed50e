"""The T5 layout rules that need no tensor: layer counts, how pipeline stages share out encoder and
decoder, and what a config or layout cannot do for T5. `Layout.problems` asks `t5_layout_problems`
for a T5 (this module imports nothing from `core.parallel`, as `core.config` must not); the
tensor-parallel rules are in `core.models.t5.sharding`.

Pipeline (`t5_stage_split`, `t5_stage_layers`): the first `encoder_stages` stages hold the
encoder (stage 0 also the shared embedding), the rest the decoder (its first stage another
copy of the embedding; the last stage the decoder norm and the output). Megatron calls the
first decoder stage the split rank. By default the stages are shared out in proportion to the
layer counts (at least one each).
"""

from __future__ import annotations

from tessera.core.config import ConfigError, Layout, ModelConfig, divisors

# What T5 training runs with beyond the layout rules below: no activation recomputation, and
# no FP8 (it covers the decoder-only blocks). `training.t5_objective.problems` refuses the rest
# as flags; the planner (`tessera.plan`) searches only these.
T5_RECOMPUTE = ("none",)
T5_REFUSED_PRECISIONS = ("fp8",)


def decoder_layers(config: ModelConfig) -> int:
    """The decoder's layer count (`options.num_decoder_layers`, by default the encoder's)."""
    layers = config.options.num_decoder_layers
    return config.num_layers if layers is None else layers


def t5_stage_split(config: ModelConfig, num_stages: int, encoder_stages: int | None = None
                   ) -> int:
    """How many of `num_stages` pipeline stages hold the encoder (the rest hold the decoder).

    One stage holds both. Otherwise `encoder_stages` (default: in proportion to the layer
    counts, at least one stage each) must leave each stack's layers evenly divided.
    """
    if num_stages == 1:
        return 1
    enc, dec = config.num_layers, decoder_layers(config)
    if encoder_stages is None:
        encoder_stages = min(num_stages - 1, max(1, round(num_stages * enc / (enc + dec))))
    if not 1 <= encoder_stages < num_stages:
        raise ConfigError(f"encoder_stages {encoder_stages} must leave at least one of the "
                          f"{num_stages} pipeline stages to each of encoder and decoder")
    dec_stages = num_stages - encoder_stages
    if enc % encoder_stages or dec % dec_stages:
        raise ConfigError(
            f"T5 with {enc} encoder and {dec} decoder layers cannot split over {encoder_stages} "
            f"encoder + {dec_stages} decoder stages evenly; use encoder stages in "
            f"{divisors(enc)} and decoder stages in {divisors(dec)}")
    return encoder_stages


def t5_stage_layers(stage_id: int, num_stages: int, config: ModelConfig,
                    encoder_stages: int | None = None) -> tuple[range, range]:
    """(encoder layers, decoder layers) that pipeline stage `stage_id` holds."""
    split = t5_stage_split(config, num_stages, encoder_stages)
    enc, dec = config.num_layers, decoder_layers(config)
    if num_stages == 1:
        return range(enc), range(dec)
    if stage_id < split:
        per = enc // split
        return range(stage_id * per, (stage_id + 1) * per), range(0)
    per, k = dec // (num_stages - split), stage_id - split
    return range(0), range(k * per, (k + 1) * per)


def t5_pipeline_sizes(config: ModelConfig) -> list[int]:
    """The pipeline stage counts `t5_stage_split` accepts for `config` (with its default
    split): 1, and those whose encoder and decoder stages divide their layers evenly."""
    out = []
    for stages in range(1, config.num_layers + decoder_layers(config) + 1):
        try:
            t5_stage_split(config, stages)
        except ConfigError:
            continue
        out.append(stages)
    return out


def t5_model_problems(config: ModelConfig) -> list[str]:
    """What a `ModelConfig` of family "t5" sets that T5 does not compute (decoder-only flags),
    each with the value T5 needs; empty when it is a T5."""
    want = {"norm": ("rmsnorm",), "position": ("relative",), "activation": ("geglu", "relu"),
            "bias": (False,), "num_kv_heads": (config.num_heads,)}
    out = [f"T5 takes {field} in {list(allowed)}, got {getattr(config, field)!r}"
           for field, allowed in want.items() if getattr(config, field) not in allowed]
    if decoder_layers(config) < 1 or config.num_layers < 1:
        out.append(f"T5 needs encoder and decoder layers, got {config.num_layers} and "
                   f"{decoder_layers(config)}")
    return out


def t5_layout_problems(config: ModelConfig, layout: Layout) -> list[str]:
    """What a layout cannot do for T5 beyond the checks every model gets (heads, ffn, ...):
    `Layout.problems` adds these for a T5 in place of the decoder-only layer split."""
    out = []
    if layout.cp > 1:
        out.append(f"T5 runs without context parallelism (cp {layout.cp}); use cp 1")
    if layout.virtual_stages > 1:
        out.append(f"T5 runs one pipeline stage per rank (virtual_stages "
                   f"{layout.virtual_stages}); use virtual_stages 1")
    try:
        t5_stage_split(config, layout.num_stages)
    except ConfigError as exc:
        out.append(str(exc))
    return out
