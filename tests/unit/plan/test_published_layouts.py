"""The planner against layouts that teams published for models they trained, beyond PTD-P.

PTD-P's Table 1 layouts follow its rule of thumb (tensor parallelism up to the node size
first); the planner disagrees for its 18.4B row (test_search.py). GPT-NeoX-20B has nearly the
same shape (44 layers, hidden 6144) and was trained on A100s with a small tensor-parallel size
and a pipeline instead, which is the planner's preference too.
"""

from __future__ import annotations

import dataclasses

from tessera.core.config import ModelConfig
from tessera.plan import Fixed, TrainingJob, load_hardware, plan_training


def test_gpt_neox_20b_published_layout():
    # EleutherAI/gpt-neox configs/20B.yml ("as it was trained on 96x 40GB A100"): tp2 pp4
    # (dp 12), ZeRO stage 1, micro-batch 4 x 32 accumulation steps = 1536 sequences of 2048,
    # full recomputation of every layer, fp16, DeepSpeed's non-interleaved 1F1B pipeline.
    # The cluster (GPT-NeoX-20B paper, section 3): 12 nodes of 8 A100-SXM4-40GB sharing four
    # 200 Gb/s HDR HCAs, i.e. 12.5 GB/s of network per GPU.
    # Not modelled here: its parallel attention + MLP residual (fewer tp all-reduces, which
    # would favour tp > 2 slightly), rotary on a quarter of each head, and DeepSpeed's pipeline
    # sending whole activations rather than tp slices.
    model = ModelConfig(name="neox-20b", family="gpt2", norm="layernorm",
                        activation="gelu_tanh", position="rope", bias=True,
                        tied_embeddings=False, vocab_size=50432, hidden_size=6144,
                        num_layers=44, num_heads=64, ffn_hidden_size=24576,
                        max_position_embeddings=2048)
    hardware = dataclasses.replace(load_hardware("a100-40gb"), inter_node_gbps=12.5)
    job = TrainingJob(model, 96, hardware, 1536, 2048, flash_attention=False,
                      overlap_grad_reduce=True, overlap_grad_reduce_in_pipeline=False,
                      grad_reduce_bytes=2)
    ranked = plan_training(job, Fixed(recompute="full", sequence_parallel=False,
                                      sharded_optimizer=True, cp=1, virtual_stages=1))
    best = ranked[0]
    published = next(c for c in ranked if (c.tp, c.pp) == (2, 4))
    rule_of_thumb = next(c for c in ranked if (c.tp, c.pp) == (8, 1))
    # Planner: best tp2 pp2 dp24 (152.7 TFLOP/s), the published tp2 pp4 148.5 (2.8% behind),
    # tp8 pp1 134.3 (12% behind).
    assert best.tp <= 4
    assert published.tokens_per_s >= best.tokens_per_s * 0.97
    assert rule_of_thumb.tokens_per_s < published.tokens_per_s * 0.92
