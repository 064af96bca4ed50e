"""Context parallelism and packed documents without spawning: the zigzag split, the ring's
block attention and log-sum-exp merge, its backward formulas, document ids and positions, packed
attention against running each document alone (and a leak test), and the configuration errors.

References are PyTorch's own `scaled_dot_product_attention` (dense causal or masked) and the
unpacked model; the multi-rank parity runs are in tests/distributed/test_context_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.core.config import ConfigError, Layout, ModelConfig, TrainSchedule
from tessera.core.init import build_model
from tessera.core.parallel import context_parallel as cpar
from tessera.core.parallel.pipeline import validate_training


def _qkv(B=2, H=4, Hkv=2, T=16, D=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, D, generator=gen, dtype=dtype) for h in (H, Hkv, Hkv)]


def test_zigzag_split_holds_chunks_r_and_2cp_minus_r_minus_1():
    assert cpar.zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cpar.zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cpar.zigzag_index(16, 4, 3).tolist() == [6, 7, 8, 9]
    x = torch.arange(2 * 24).view(2, 24)
    parts = [cpar.split_sequence(x, 1, 4, r) for r in range(4)]
    assert torch.equal(cpar.unsplit_sequence(parts, 1), x)
    # Equal causal work: every rank's queries see the same number of keys in total.
    work = [int((cpar.zigzag_index(24, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match=r"sequence length 20 is not divisible by 2 x cp = 8"):
        cpar.zigzag_index(20, 4, 0)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_ring_blocks_merged_by_lse_equal_full_sdpa(cp, packed):
    """Every cp rank's queries against the key blocks of all ranks, in ring order, merged with
    their log-sum-exp, equal dense causal (or document-masked) SDPA over the whole sequence."""
    q, k, v = _qkv()
    B, H, T, D = q.shape
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 11 + [1] * 5]) if packed else None
    if docs is None:
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask = causal & (docs[:, :, None] == docs[:, None, :])
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    parts = []
    for r in range(cp):
        seq = cpar.sequence_context(T, B, q.device, cp_size=cp, cp_rank=r, documents=docs)
        q5 = seq.split(q, 2).reshape(B, 2, 2, T // cp, D)
        out = lse = None
        for step in range(cp):
            src = (r - step) % cp
            idx = seq.rank_index(src)
            block = cpar.block_attention(q5, k[:, :, idx], v[:, :, idx], seq.mask(idx), D ** -0.5)
            out, lse = block if out is None else cpar.merge_partials(out, lse, *block)
        parts.append(out.reshape(B, H, T // cp, D))
    got = cpar.unsplit_sequence(parts, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_merge_partials_handles_rows_without_keys():
    out = torch.ones(1, 3, 2)
    lse = torch.tensor([[0.0, float("-inf"), 1.0]])
    blk = torch.full((1, 3, 2), 2.0)
    blk_lse = torch.tensor([[float("-inf"), float("-inf"), 1.0]])
    merged, new = cpar.merge_partials(out, lse, blk, blk_lse)
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged[0, 0], torch.ones(2))  # the block saw nothing
    torch.testing.assert_close(merged[0, 1], torch.zeros(2))  # neither did: output 0
    torch.testing.assert_close(merged[0, 2], torch.full((2,), 1.5))  # equal weights
    assert new[0, 1] == float("-inf")


def test_ring_backward_formulas_match_autograd_of_sdpa():
    """The ring's hand-written backward (one block: cp 1), with GQA and documents."""
    q, k, v = (t.requires_grad_() for t in _qkv(seed=1))
    T = q.shape[2]
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 3 + [1] * 3 + [2] * 10])
    seq = cpar.sequence_context(T, 2, q.device, documents=docs)
    got = cpar._RingAttention.apply(q, k, v, seq)
    mask = torch.ones(T, T, dtype=torch.bool).tril() & (docs[:, :, None] == docs[:, None, :])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v), g)
    refs = torch.autograd.grad(want, (q, k, v), g)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_document_ids_and_positions_from_eod():
    eod = 9
    tokens = torch.tensor([[5, 6, 9, 7, 9, 1, 2, 3]])
    docs = cpar.document_ids(tokens, eod)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]  # the EOD closes its own document
    assert cpar.document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


def _tiny(preset: str) -> ModelConfig:
    return ModelConfig.from_name(preset, hidden_size=32, num_layers=2, num_heads=4,
                                 ffn_hidden_size=64, vocab_size=96, max_position_embeddings=64)


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"], ids=["gqa-rope", "learned"])
def test_packed_documents_equal_each_document_alone(preset):
    """Must-show 2: logits of a packed row equal each document run by itself (positions restart
    per document), and changing one document never moves another's logits."""
    config = _tiny(preset)
    model = build_model(config, seed=3).eval()
    gen = torch.Generator().manual_seed(4)
    lengths = [5, 8, 3]
    ids = torch.randint(0, config.vocab_size, (1, sum(lengths)), generator=gen)
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = model(ids, document_ids=docs)
        start = 0
        for n in lengths:
            alone = model(ids[:, start:start + n])
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=0, atol=1e-5)
            start += n
        # Leak test: rewrite the first document; the others must not move at all.
        changed = ids.clone()
        changed[0, :lengths[0]] = (changed[0, :lengths[0]] + 1) % config.vocab_size
        after = model(changed, document_ids=docs)
        assert torch.equal(after[:, lengths[0]:], packed[:, lengths[0]:])
        # ... whereas without document ids they do (the test can catch a leak).
        assert not torch.allclose(model(changed)[:, lengths[0]:], model(ids)[:, lengths[0]:])


def test_bad_cp_configurations_name_numbers_and_fix():
    """Must-show 4: the layout / schedule checks that run before training."""
    model = _tiny("llama-tiny")
    problems = Layout(cp=4).problems(model, world_size=4, seq_len=20)
    assert any("sequence length 20 is not divisible by 2 x cp = 8" in p and "multiple of 8" in p
               for p in problems), problems
    problems = Layout(tp=2, cp=2).problems(model, world_size=6, seq_len=16)
    assert any("world size 6 != tp 2 x cp 2 x pp 1 x dp 1 = 4" in p for p in problems), problems
    problems = Layout(tp=4, cp=2, sequence_parallel=True).problems(model, seq_len=20)
    assert any("10 tokens (sequence length 20 / cp 2) do not split over tp 4" in p
               for p in problems), problems
    assert Layout(cp=0).problems(model) == ["cp must be >= 1, got 0"]
    with pytest.raises(ConfigError, match=r"split-backward .* use '1f1b'"):
        validate_training(model, Layout(pp=2, cp=2, virtual_stages=2, placement="v"),
                          TrainSchedule(schedule="zbv", micro_batches=4), seq_len=16)
    # The ring applies attention dropout (test_ring_dropout_*): no longer refused.
    validate_training(ModelConfig.from_name("gpt2-tiny", dropout=0.1), Layout(cp=2),
                      TrainSchedule(cp_comm="ring"))
    with pytest.raises(ConfigError, match=r"unknown cp_comm 'p2p'; choose one of"):
        validate_training(model, Layout(cp=2), TrainSchedule(cp_comm="p2p"))
    assert Layout.from_dict({"tp": 2, "pp": 1, "virtual_stages": 1}).cp == 1  # old manifests


def test_pretrain_flags_take_cp_and_check_it(tmp_path):
    from tessera.training.config import load_config
    from tessera.training.run_plan import resolve_plan

    cfg, _ = load_config(["--cp", "2", "--cp-comm", "ring", "--seq-len", "30",
                          "--model", "llama-tiny", "--global-batch", "2"])
    assert (cfg.parallel.layout().cp, cfg.parallel.train_schedule().cp_comm) == (2, "ring")
    with pytest.raises(ConfigError, match=r"sequence length 30 is not divisible by 2 x cp = 4"):
        resolve_plan(cfg, 2)
    cfg, _ = load_config(["--cp", "2", "--seq-len", "32", "--model", "llama-tiny",
                          "--global-batch", "4"])
    assert resolve_plan(cfg, 4).layout.dp == 2  # dp fills what tp x cp x pp leave of the world
    # Isolating documents needs the tokenizer's EOD id; refused before any data is read.
    from tessera.training.loop import _data_model

    cfg, _ = load_config(["--data", str(tmp_path / "none"), "--isolate-documents", "true"])
    with pytest.raises(ConfigError, match="--isolate-documents .* pass --tokenizer"):
        _data_model(resolve_plan(cfg, 1), cfg.model_fields_set)


def test_tuning_refuses_dynamic_cp():
    """Tuning runs fixed cp (tests/distributed/test_tuning_*.py); dynamic cp has nothing to
    spread in rows of one padded example each, and says so."""
    from tessera.tuning.config import load_config as load_tune_config
    from tessera.tuning.loop import prepare_inputs

    cfg, _ = load_tune_config(["--cp", "2", "--cp-dynamic", "true"])
    with pytest.raises(ConfigError, match=r"tuning rows are single examples.*use fixed --cp"):
        prepare_inputs(cfg)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_skips_only_pairs_above_the_causal_diagonal(cp):
    """At every ring step after the first, the ring computes half a block, and every query-key
    pair it skips is masked (so skipping changes nothing); the own block is computed whole."""
    T = 8 * cp
    for r in range(cp):
        seq = cpar.sequence_context(T, 1, torch.device("cpu"), cp_size=cp, cp_rank=r)
        for step in range(cp):
            src = (r - step) % cp
            full = seq.mask(seq.rank_index(src))[0]  # (T_local, T_local)
            qs, ks = cpar.visible_block(step, src, r, T // cp // 2)
            kept = torch.zeros_like(full)
            kept[qs, ks] = True
            assert not (full & ~kept).any(), (cp, r, step)  # nothing visible is skipped
            assert kept.sum() == full.numel() // (1 if step == 0 else 2)


def _dense_dropout_attention(q, k, v, mask, keep):
    """Reference: masked softmax, the probabilities times `keep`, then the values (GQA 4:2)."""
    B, H, T, D = q.shape
    kk, vv = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    s = (q @ kk.transpose(-1, -2)) * D ** -0.5
    p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), -1)
    return (p * keep.reshape(B, H, T, T)) @ vv


def test_ring_dropout_is_dropout_with_a_hashed_mask_and_exact_gradients():
    """Ring attention dropout (cp 1: its formulas) equals dense attention whose probabilities are
    multiplied by the same `dropout_scale` mask, output and gradients; the same seed gives the
    same result, another seed another; kept pairs are 1 - p of all, scaled by 1 / (1 - p)."""
    q, k, v = (t.requires_grad_() for t in _qkv(seed=2))
    B, H, T, D = q.shape
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 3 + [1] * 3 + [2] * 10])
    seq = cpar.sequence_context(T, B, q.device, documents=docs)
    p = 0.3
    got = cpar._RingAttention.apply(q, k, v, seq, p, 1234)
    keep = cpar.dropout_scale(1234, p, (B, 2, 2), torch.arange(T), torch.arange(T))
    mask = torch.ones(T, T, dtype=torch.bool).tril() & (docs[:, :, None] == docs[:, None, :])
    want = _dense_dropout_attention(q, k, v, mask, keep)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    again = cpar._RingAttention.apply(q, k, v, seq, p, 1234)
    assert torch.equal(again, got)
    assert not torch.allclose(cpar._RingAttention.apply(q, k, v, seq, p, 99), got)
    big = cpar.dropout_scale(7, p, (4, 4, 2), torch.arange(256), torch.arange(256))
    values = big.unique().tolist()
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(1 / (1 - p))
    assert abs((big > 0).float().mean().item() - (1 - p)) < 0.003  # 524288 pairs


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_dropout_mask_does_not_depend_on_the_split(cp):
    """Emulated cp ranks (blocks skipped as the ring skips them, merged by log-sum-exp), each
    hashing its own pairs by global index, give the one-block result for the same seed."""
    q, k, v = _qkv(seed=3)
    B, H, T, D = q.shape
    p, seed = 0.2, 5
    keep = cpar.dropout_scale(seed, p, (B, 2, 2), torch.arange(T), torch.arange(T))
    want = _dense_dropout_attention(q, k, v, torch.ones(T, T, dtype=torch.bool).tril()[None], keep)
    parts = []
    for r in range(cp):
        seq = cpar.sequence_context(T, B, q.device, cp_size=cp, cp_rank=r)
        q5 = seq.split(q, 2).reshape(B, 2, 2, T // cp, D)
        out = lse = None
        for step in range(cp):
            src = (r - step) % cp
            qs, ks = cpar.visible_block(step, src, r, T // cp // 2)
            idx = seq.rank_index(src)[ks]
            blk_keep = cpar.dropout_scale(seed, p, (B, 2, 2), seq.index[qs], idx)
            block = cpar.block_attention(q5[:, :, :, qs], k[:, :, idx], v[:, :, idx],
                                         seq.mask(idx)[:, qs], D ** -0.5, blk_keep)
            if out is None:
                out, lse = block
            else:
                out[:, :, :, qs], lse[..., qs] = cpar.merge_partials(out[:, :, :, qs],
                                                                     lse[..., qs], *block)
        parts.append(out.reshape(B, H, T // cp, D))
    torch.testing.assert_close(cpar.unsplit_sequence(parts, 2), want, rtol=0, atol=1e-12)
