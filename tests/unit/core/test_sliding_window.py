"""Sliding-window attention in the core (`core.sliding_window`): the config fields and their
errors, the training mask against a dense reference, packed documents (window AND same
document) against each document alone, context parallelism's mask and ring formulas, the
paged decode kernels with the blocks before the window replaced by the scratch block, and the
refusal of dynamic cp. transformers parity is in tests/unit/converters/test_hf_sliding_window.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.core.config import ConfigError, ModelConfig
from tessera.core.init import build_model
from tessera.core.paged_attention import paged_decode_attention
from tessera.core.parallel import context_parallel as cpar
from tessera.core.sliding_window import causal_window_mask, first_visible

WINDOW = 4


def _config(**fields) -> ModelConfig:
    return ModelConfig.from_name("llama-tiny", **{
        "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "ffn_hidden_size": 64, "vocab_size": 96, "max_position_embeddings": 64,
        "sliding_window": WINDOW, **fields})


def test_a_query_sees_itself_and_the_window_minus_one_keys_before_it():
    mask = causal_window_mask(6, 3, "cpu")
    assert mask[5].tolist() == [False, False, False, True, True, True]
    assert mask[1].tolist() == [True, True, False, False, False, False]
    assert first_visible(5, 3) == 3 and first_visible(1, 3) == 0 and first_visible(9, None) == 0


def test_config_fields_and_their_errors():
    config = _config(sliding_window_layers=[1])
    assert config.sliding_window_layers == (1,)
    assert [config.layer_window(i) for i in range(2)] == [None, WINDOW]
    assert _config().layer_window(0) == WINDOW
    assert ModelConfig.from_dict(config.to_dict()) == config
    cases = {
        "sliding_window=0 must be a positive number": dict(sliding_window=0),
        "sliding_window_layers=[1] needs a sliding_window": dict(sliding_window=None,
                                                                 sliding_window_layers=[1]),
        "sliding_window_layers [2] are not layers of a 2-layer model":
            dict(sliding_window_layers=[2]),
        "sliding_window_rope_theta=100.0 needs a sliding_window":
            dict(sliding_window=None, sliding_window_rope_theta=100.0),
        "sliding_window_rope_theta=0.0 must be a RoPE base > 0":
            dict(sliding_window_rope_theta=0.0),
        "sliding_window_rope_theta=100.0 needs position='rope', not 'learned'": dict(
            position="learned", sliding_window_rope_theta=100.0),
    }
    for message, change in cases.items():
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            _config(**change)
    with pytest.raises(ConfigError, match="sliding_window=4 is supported by the decoder "
                                          "families only, not 't5'"):
        ModelConfig.from_name("t5-tiny", sliding_window=WINDOW)


def _dense_window_attention(model, ids, window, docs=None):
    """The model's logits with every layer's attention replaced by SDPA under an explicit
    causal-window (and same-document) mask: the reference for the model's own masking."""
    T = ids.shape[1]
    mask = causal_window_mask(T, window, ids.device)[None]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    for layer in model.layers.values():
        layer.attention._core = lambda q, k, v, m, seq=None: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    try:
        return model(ids, positions=None if docs is None else cpar.document_positions(docs))
    finally:
        for layer in model.layers.values():
            del layer.attention._core


@torch.no_grad()
def test_training_mask_is_the_causal_window():
    model = build_model(_config(), seed=0).eval()
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    got = model(ids)
    torch.testing.assert_close(got, _dense_window_attention(model, ids, WINDOW), rtol=0,
                               atol=1e-5)
    full = build_model(_config(sliding_window=None), seed=0).eval()
    assert not torch.allclose(full(ids), got, atol=1e-3)  # the window changes the logits
    torch.testing.assert_close(full(ids)[:, :WINDOW], got[:, :WINDOW], rtol=0, atol=1e-5)


@torch.no_grad()
def test_packed_documents_with_a_window_equal_each_document_alone():
    model = build_model(_config(), seed=3).eval()
    lengths = [9, 3, 8]
    ids = torch.randint(0, 96, (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    packed = model(ids, document_ids=docs)
    start = 0
    for n in lengths:
        alone = model(ids[:, start:start + n])
        torch.testing.assert_close(packed[:, start:start + n], alone, rtol=0, atol=1e-5)
        start += n
    torch.testing.assert_close(packed, _dense_window_attention(model, ids, WINDOW, docs),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_blocks_with_a_window_equal_dense_window_attention(cp):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    docs = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    mask = causal_window_mask(16, WINDOW, "cpu")[None] & (docs[:, :, None] == docs[:, None, :])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    parts = []
    for r in range(cp):
        seq = cpar.sequence_context(16, 2, q.device, cp_size=cp, cp_rank=r, documents=docs)
        q5 = seq.split(q, 2).reshape(2, 2, 2, 16 // cp, 8)
        out = lse = None
        for step in range(cp):
            idx = seq.rank_index((r - step) % cp)
            block = cpar.block_attention(q5, k[:, :, idx], v[:, :, idx],
                                         seq.mask(idx, WINDOW), 8 ** -0.5)
            out, lse = block if out is None else cpar.merge_partials(out, lse, *block)
        parts.append(out.reshape(2, 4, 16 // cp, 8))
    torch.testing.assert_close(cpar.unsplit_sequence(parts, 2), want, rtol=0, atol=1e-12)


def test_ring_formulas_with_a_window_match_autograd_of_sdpa():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 16, 8, generator=gen, dtype=torch.float64).requires_grad_()
               for h in (4, 2, 2))
    seq = cpar.sequence_context(16, 2, q.device)
    got = cpar._RingAttention.apply(q, k, v, seq, 0.0, 0, WINDOW)
    mask = causal_window_mask(16, WINDOW, "cpu")
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_dynamic_cp_refuses_a_window():
    from tessera.core.config import Layout, TrainSchedule
    from tessera.core.parallel.pipeline import validate_training

    with pytest.raises(ConfigError, match="the model has sliding_window=4; use a fixed cp"):
        validate_training(_config(), Layout(cp=2), TrainSchedule(cp_dynamic=True))
    validate_training(_config(), Layout(cp=2), TrainSchedule())
    segmented = cpar.SegmentedContext((), (), torch.zeros(1, 0, dtype=torch.long), 2, None)
    q = torch.zeros(1, 4, 0, 8)
    with pytest.raises(NotImplementedError, match="dynamic context parallelism does not "
                                                  "support sliding_window=4"):
        cpar.attention(q, q, q, segmented, window=WINDOW)


@pytest.mark.parametrize("kernel", ["gather", "flex"])
def test_paged_decode_sees_only_the_window(kernel):
    """Rows whose blocks before the window were given back (their table entries: the scratch
    block 0, full of other keys) attend exactly to their last `window` positions."""
    gen = torch.Generator().manual_seed(2)
    block, window = 4, 6
    keys, values = (torch.randn(12, block, 2, 8, generator=gen) for _ in range(2))
    lengths = [15, 7, 3]
    tables = torch.tensor([[0, 0, 5, 6], [1, 2, 0, 0], [3, 0, 0, 0]])
    held = [[9, 4, 5, 6], [1, 2], [3]]  # row 0's first two blocks were 9 and 4, now given back
    q = torch.randn(3, 4, 1, 8, generator=gen)
    got = paged_decode_attention(q, keys, values, tables, torch.tensor(lengths) - 1, kernel,
                                 window)
    for r, (n, blocks) in enumerate(zip(lengths, held)):
        k = keys[blocks].reshape(-1, 2, 8)[max(0, n - window):n].transpose(0, 1)[None]
        v = values[blocks].reshape(-1, 2, 8)[max(0, n - window):n].transpose(0, 1)[None]
        want = F.scaled_dot_product_attention(q[r:r + 1], k, v, enable_gqa=True)
        torch.testing.assert_close(got[r:r + 1], want, rtol=0, atol=1e-5)
