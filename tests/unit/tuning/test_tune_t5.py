"""LoRA tuning of a T5 base on text-to-text rows: the encoder reads the task's input, the
decoder is taught the answer by teacher forcing. A tiny random HF T5 (built locally, nothing
downloaded) is imported and tuned a few steps: only the LoRA factors learn, every base weight
stays bit-identical, the loss falls, and the loss Tessera computes for a batch equals
transformers' `T5ForConditionalGeneration` loss with the same adapter attached by peft
(exported with `tessera convert --to peft`). `tessera serve --lora NAME=DIR` on the T5 base
answers a request naming the adapter with the greedy tokens of that peft model.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.core.checkpoint import CheckpointReader, save_checkpoint  # noqa: E402
from tessera.core.config import ConfigError  # noqa: E402
from tessera.core.lora import set_lora_dropout  # noqa: E402
from tessera.core.lora_format import save_adapter  # noqa: E402
from tessera.core.models.t5.init import load_t5_checkpoint  # noqa: E402
from tessera.core.models.t5.tokens import SentinelTokenizer  # noqa: E402
from tessera.core.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402
from tessera.serving.cli import build_parser, served_names  # noqa: E402
from tessera.serving.http.family_apps import app_for_family  # noqa: E402
from tessera.training.loop import train_step  # noqa: E402
from tessera.tuning.config import load_config  # noqa: E402
from tessera.tuning.loop import prepare_inputs, setup, train_inputs  # noqa: E402
from tessera.tuning.lora_state import gather_adapter  # noqa: E402
from tests.unit.converters.hf_family_checks import convert, perturbed  # noqa: E402
from tests.unit.tuning.tuning_helper import corpus, task_examples, tune_argv, write_jsonl  # noqa: E402

STEPS = 10
VOCAB = 384  # the tokenizer's
SENTINELS = 16  # the model's ids above the tokenizer's, as `tessera serve` places them
T5 = dict(vocab_size=VOCAB + SENTINELS, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
          num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
          dropout_rate=0.0, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
LORA = ("--method", "lora", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all",
        "--lr", "1e-2")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The imported tiny T5 saved with the tuning tokenizer, its HF directory and train data."""
    root = tmp_path_factory.mktemp("t5tune")
    tok = root / "tok.model"
    train_tokenizer([], VOCAB, tok, "bpe", texts=corpus(300), num_threads=1)
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5))
    hf.lm_head.weight = torch.nn.Parameter(torch.randn(T5["vocab_size"], T5["d_model"]))
    perturbed(hf).save_pretrained(root / "hf")
    imported = load_t5_checkpoint(str(import_hf(root / "hf", root / "imported")))
    save_checkpoint(root / "base", [imported], tokenizer=tok)
    return root, write_jsonl(root / "train.jsonl", task_examples("kind", "train", 64))


def _tuned(root, train, run):
    cfg, _ = load_config(tune_argv(root / "base", run, train, None, "--steps", str(STEPS),
                                   *LORA))
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    return inputs, setup(cfg, inputs)


def test_t5_lora_trains_only_the_adapter_and_matches_peft_loss(base, tmp_path):
    root, train = base
    inputs, t = _tuned(root, train, tmp_path / "run")
    model = t.job.stages[0]
    tuned = {n for n, p in model.named_parameters() if p.requires_grad}
    assert tuned and all(".lora_" in n for n in tuned), tuned
    assert any(".cross_attention." in n for n in tuned)
    losses = []
    for step in range(STEPS):
        tokens, labels, extra = train_inputs(t, inputs.train, step)
        losses.append(train_step(t.job, step, tokens, labels, extra)["loss"])
        for name, p in model.named_parameters():
            assert (p.grad is not None) == (name in tuned), name
    reader = CheckpointReader(root / "base")
    for name, p in model.named_parameters():
        if name not in tuned:
            assert torch.equal(p, reader.global_tensor(name)), name
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.05, losses

    # The tuned adapter, attached by peft to transformers' T5: the same loss on a batch.
    save_adapter(tmp_path / "adapter", t.lora, gather_adapter(t.job.stages))
    convert("--to", "peft", "--input", tmp_path / "adapter", "--checkpoint", root / "base",
            "--output", tmp_path / "peft")
    encoder_ids, labels, extra = train_inputs(t, inputs.train, STEPS)
    assert (labels != -100).sum() < labels.numel()  # padded answers: the mask matters
    set_lora_dropout(t.job.stages, False)
    with torch.no_grad():
        ours = model(encoder_ids, labels=labels, **extra).item()
    hf = transformers.T5ForConditionalGeneration.from_pretrained(root / "hf").float()
    reference = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    with torch.no_grad():
        want = reference(input_ids=encoder_ids, attention_mask=extra["encoder_mask"],
                         decoder_input_ids=extra["decoder_input_ids"], labels=labels).loss.item()
        with reference.disable_adapter():  # the adapter must matter
            plain = reference(input_ids=encoder_ids, attention_mask=extra["encoder_mask"],
                              decoder_input_ids=extra["decoder_input_ids"],
                              labels=labels).loss.item()
    assert abs(ours - want) <= 1e-5, (ours, want)
    assert abs(plain - want) > 1e-3, (plain, want)


@pytest.mark.parametrize("flags, words", [
    (("--method", "prompt-tuning"), "--method lora"),
    ((*LORA, "--pack", "true"), "drop --pack"),
])
def test_t5_refuses_what_it_cannot_tune(base, tmp_path, flags, words):
    root, train = base
    cfg, _ = load_config(tune_argv(root / "base", tmp_path / "run", train, None, *flags))
    with pytest.raises(ConfigError, match=words):
        prepare_inputs(cfg, train=cfg.tune.data)


def test_t5_refuses_dpo(base, tmp_path):
    from tessera.tuning.dpo_loop import prepare_dpo

    root, train = base
    cfg, _ = load_config(tune_argv(root / "base", tmp_path / "run", train, None,
                                   "--method", "dpo"))
    with pytest.raises(ConfigError, match="--method dpo needs a decoder"):
        prepare_dpo(cfg)


def test_t5_refuses_validation_data(base, tmp_path):
    root, train = base
    cfg, _ = load_config(tune_argv(root / "base", tmp_path / "run", train, train, *LORA))
    with pytest.raises(ConfigError, match="--valid"):
        prepare_inputs(cfg, train=cfg.tune.data, valid=cfg.tune.valid)


@torch.no_grad()
def _peft_greedy(reference, ids: list[int], steps: int, eos_id: int) -> list[int]:
    """Greedy decoding by repeated full forward passes of the peft model, cut at EOS."""
    out: list[int] = []
    for _ in range(steps):
        logits = reference(input_ids=torch.tensor([ids]),
                           decoder_input_ids=torch.tensor([[0, *out]])).logits
        out.append(int(logits[0, -1].argmax()))
        if out[-1] == eos_id:
            return out[:-1]
    return out


def test_t5_serves_the_tuned_adapter_with_peft_greedy_tokens(base, tmp_path):
    from fastapi.testclient import TestClient

    root, train = base
    inputs, t = _tuned(root, train, tmp_path / "run")
    for step in range(STEPS):
        tokens, labels, extra = train_inputs(t, inputs.train, step)
        train_step(t.job, step, tokens, labels, extra)
    save_adapter(tmp_path / "adapter", t.lora, gather_adapter(t.job.stages))
    convert("--to", "peft", "--input", tmp_path / "adapter", "--checkpoint", root / "base",
            "--output", tmp_path / "peft")
    hf = transformers.T5ForConditionalGeneration.from_pretrained(root / "hf").float()
    reference = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    tok = SentinelTokenizer(load_tokenizer(root / "base"), SENTINELS)
    text = "kinds: we saw a red box"
    want = _peft_greedy(reference, tok.encode(text, eos=True), 10, tok.eos_id)
    with reference.disable_adapter():
        plain = _peft_greedy(reference, tok.encode(text, eos=True), 10, tok.eos_id)
    assert len(want) >= 8 and want != plain, (want, plain)

    args = build_parser().parse_args(["--checkpoint", str(root / "base"),
                                      "--lora", f"tuned={tmp_path / 'adapter'}"])
    body = {"prompt": text, "max_tokens": 10, "temperature": 0}
    with TestClient(app_for_family(args, served_names(args))) as client:
        tuned = client.post("/v1/completions", json={**body, "model": "tuned"})
        assert tuned.status_code == 200, tuned.text
        assert tuned.json()["choices"][0]["text"] == tok.decode(want)
        served = client.post("/v1/completions", json={**body, "model": "base"})
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["text"] == tok.decode(plain)
        missing = client.post("/v1/completions", json={**body, "model": "other"})
        assert missing.status_code == 404, missing.text


def test_t5_serving_refuses_runtime_adapters(base):
    root, _ = base
    args = build_parser().parse_args(["--checkpoint", str(root / "base"),
                                      "--allow-runtime-lora"])
    with pytest.raises(ValueError, match="drop --allow-runtime-lora"):
        app_for_family(args, served_names(args))


def test_t5_tune_run_writes_an_adapter_of_encoder_and_decoder_modules(base, tmp_path):
    from tessera.core.lora_format import load_adapter
    from tessera.tuning.loop import tune

    root, train = base
    cfg, _ = load_config(tune_argv(root / "base", tmp_path / "run", train, None, *LORA,
                                   "--steps", "3"))
    summary = tune(cfg)
    config, tensors = load_adapter(summary["adapter"])
    assert {m.split(".")[0] for m in config.modules} == {"encoder", "decoder"}
    assert len(tensors) == 2 * len(config.modules)
    assert all(torch.isfinite(torch.tensor(summary["losses"])))
