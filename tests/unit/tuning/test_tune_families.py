"""Tuning on each converted Hugging Face family: a tiny random model built by transformers from a
config (nothing downloaded) and imported (`tessera convert --from hf`) is tuned for a few steps
by prompt tuning, p-tuning and LoRA. Only the prompts / the adapter get gradients, every base
weight stays bit-identical to the imported checkpoint, the loss falls, and the result is served
by the engine (the task's table, or the adapter loaded by name) with the greedy tokens of the
full forward pass of the base with the prompts or the adapter attached.

The families' traits: Qwen2's q/k/v biases and tied output, Phi-3's partial rotary, OLMo-2's
output norms and projection qk-norm, Gemma 2's soft caps, scaled embeddings and sandwich norms,
Gemma 3's local layers (window 8, their own RoPE base) and q/k norms, DeepSeek-V3's latent
attention with a group-routed MoE layer and shared expert, Qwen2-MoE's biases and shared-expert
MoE layer, Mistral's window (8, shorter than the tuned
rows), and Llama with llama3 and yarn rope past an original length of 16.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.core.checkpoint import CheckpointReader, load_checkpoint, save_checkpoint  # noqa: E402
from tessera.core.lora import attach_lora  # noqa: E402
from tessera.core.lora_format import save_adapter  # noqa: E402
from tessera.core.prompts import FixedPrompt, VirtualPrompts, attach_prompts  # noqa: E402
from tessera.core.tokenizer import train_tokenizer  # noqa: E402
from tessera.serving.engine import LLMEngine  # noqa: E402
from tessera.serving.engine.adapters import LoRAServing  # noqa: E402
from tessera.serving.engine.executor import LocalExecutor  # noqa: E402
from tessera.serving.engine.runner import ModelRunner  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402
from tessera.training.loop import train_step  # noqa: E402
from tessera.tuning.config import load_config  # noqa: E402
from tessera.tuning.loop import prepare_inputs, setup, train_batch  # noqa: E402
from tessera.tuning.lora_state import gather_adapter  # noqa: E402
from tests.serving_helper import collect, full_forward_greedy  # noqa: E402
from tests.unit.converters.hf_family_checks import perturbed  # noqa: E402
from tests.unit.tuning.tuning_helper import corpus, task_examples, tune_argv, write_jsonl  # noqa: E402

STEPS = 10
VOCAB = 384  # the tokenizer's
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
_ORIGINAL_16 = dict(original_max_position_embeddings=16, rope_theta=10000.0)
FAMILIES = {
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5)),
    "olmo2": ("Olmo2Config", {}),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=64, query_pre_attn_scalar=12,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(qkv_bias=True, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16, decoder_sparse_step=2,
                                         shared_expert_intermediate_size=32)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=12,
                                        layer_types=["sliding_attention", "full_attention"],
                                        rope_local_base_freq=100.0)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        moe_intermediate_size=16)),
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "llama3-rope": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        **_ORIGINAL_16))),
    "yarn-rope": ("LlamaConfig", dict(rope_parameters=dict(rope_type="yarn", factor=4.0,
                                                           **_ORIGINAL_16))),
}
METHODS = {"prompt-tuning": ("--lr", "0.1"), "p-tuning": ("--lr", "0.03"),
           "lora": ("--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all",
                    "--lr", "1e-2")}


@pytest.fixture(scope="module")
def tokenizer_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    tok = root / "tok.model"
    train_tokenizer([], VOCAB, tok, "bpe", texts=corpus(300), num_threads=1)
    return tok, write_jsonl(root / "train.jsonl", task_examples("kind", "train", 64))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_base(request, tokenizer_and_data, tmp_path_factory):
    """The family's imported checkpoint, saved again with the tuning tokenizer."""
    tok, train = tokenizer_and_data
    root = tmp_path_factory.mktemp(request.param)
    cls, fields = FAMILIES[request.param]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls)(**{**_COMMON, **fields}))
    perturbed(hf).save_pretrained(root / "hf")
    imported = load_checkpoint(import_hf(root / "hf", root / "imported"))
    return request.param, save_checkpoint(root / "base", imported, tokenizer=tok), train


def _tune(base, train, run, method):
    """`STEPS` steps in memory: only the tuned parameters get gradients, every other one stays
    bit-identical to the base checkpoint, and the loss falls. Returns the tuning state."""
    cfg, _ = load_config(tune_argv(base, run, train, None, "--steps", str(STEPS),
                                   "--method", method, *METHODS[method]))
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    t = setup(cfg, inputs)
    model = t.job.stages[0]
    tuned = {n for n, p in model.named_parameters() if p.requires_grad}
    marker = ".lora_" if method == "lora" else "embedding_hook."
    assert tuned and all(marker in n for n in tuned), tuned
    losses = []
    for step in range(STEPS):
        tokens, labels = train_batch(t, inputs.train, step)
        losses.append(train_step(t.job, step, tokens, labels)["loss"])
        for name, p in model.named_parameters():
            assert (p.grad is not None) == (name in tuned), name
    reader = CheckpointReader(base)
    for name, p in model.named_parameters():
        if name not in tuned:
            assert torch.equal(p, reader.global_tensor(name)), name
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.05, losses
    return t


def _served(runner, request, adapter=None):
    with LLMEngine(LocalExecutor(runner)) as engine:
        if adapter is not None:
            engine.load_adapter("tuned", adapter)
        return collect(engine, [request])[0].token_ids


PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48]  # with 8 virtual tokens: past Mistral's window


@pytest.mark.parametrize("method", list(METHODS))
def test_tuned_family_trains_and_serves(family_base, method, tmp_path):
    name, base, train = family_base
    t = _tune(base, train, tmp_path / "run", method)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = load_checkpoint(base).eval()
    if method == "lora":
        adapter = save_adapter(tmp_path / "adapter", t.lora, gather_adapter(t.job.stages))
        runner = ModelRunner(load_checkpoint(base).eval(), 2,
                             lora=LoRAServing(checkpoint=str(base)))
        got = _served(runner, GenerationRequest("r", PROMPT, params, adapter="tuned"), adapter)
        attach_lora([reference], t.lora, tensors=gather_adapter(t.job.stages))
        context = PROMPT
    else:
        tables = t.prompts.tables()
        runner = ModelRunner(load_checkpoint(base).eval(), 2, tasks=tables)
        got = _served(runner, GenerationRequest("r", PROMPT, params, task="kind"))
        hook = attach_prompts(reference, VirtualPrompts({"kind": FixedPrompt(tables["kind"])},
                                                        rows_from_ids=False))
        hook.set_rows(torch.tensor([0]))
        context = [0] * tables["kind"].shape[0] + PROMPT
    with torch.no_grad():
        assert got == full_forward_greedy(reference, context, 6)[0], (name, method)
        # The tuned prompts / adapter matter: the bare base continues otherwise.
        assert got != full_forward_greedy(load_checkpoint(base).eval(), context, 6)[0]


@pytest.mark.parametrize("family_base", ["gemma2"], indirect=True)
def test_packing_a_gemma2_base_is_refused_by_field(family_base, tmp_path):
    """Packed rows run the packed-document attention, which has no soft cap: refused before
    anything is built, naming the field."""
    from tessera.core.config import ConfigError

    _, base, train = family_base
    cfg, _ = load_config(tune_argv(base, tmp_path / "run", train, None, "--method", "lora",
                                   "--pack", "true"))
    with pytest.raises(ConfigError, match=r"--pack: .*attn_logit_softcapping=2.0; tune without"):
        prepare_inputs(cfg, train=cfg.tune.data)
