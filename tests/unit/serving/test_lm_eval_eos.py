"""lm-evaluation-harness (`local-completions`, remote tokenizer) against a model whose greedy
next token is EOS after every context: the generated token of lm-eval's loglikelihood request
(`echo`, `logprobs: 1`, `max_tokens: 1`) ends the request, and its logprob must still be in the
answer, or lm-eval's `token_logprobs[ctxlen:-1]` drops the last continuation token.

A tiny Llama is edited so that EOS wins by a wide margin everywhere (a constant direction in
every embedding, read by EOS's output row), exported to Hugging Face, and given a PEFT adapter
on every linear with random nonzero A and B (no training steps: training on ordinary text would
teach it to undo the edit). References: transformers on the export for the base,
peft's `PeftModel` for the adapter (served by its name). Every log-likelihood lm-eval reports,
multiple-choice and rolling, equals the reference within 1e-4.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks read local files; never the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tessera.converters.hf_io import export_hf  # noqa: E402
from tessera.converters.peft_lora import read_any_adapter  # noqa: E402
from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.core.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from tessera.serving.engine import LLMEngine  # noqa: E402
from tessera.serving.engine.adapters import LoRAServing  # noqa: E402
from tessera.serving.engine.executor import LocalExecutor  # noqa: E402
from tessera.serving.engine.kv_config import KVCacheConfig  # noqa: E402
from tessera.serving.engine.runner import ModelRunner  # noqa: E402
from tessera.serving.http.app import create_app  # noqa: E402
from tests.serving_helper import running_server, train_tiny_tokenizer  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_tasks"
CONFIG = ModelConfig(name="eos-first", vocab_size=512, hidden_size=64, num_layers=2,
                     num_heads=8, num_kv_heads=4, ffn_hidden_size=96, max_position_embeddings=128)
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KV = KVCacheConfig(kind="paged", block_size=8)
MC_TASK = f"""task: eos_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {TASKS / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
ROLLING_TASK = f"""task: eos_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {TASKS / "gen.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: "{{{{prompt}}}}{{{{target}}}}"
doc_to_target: "{{{{prompt}}}}{{{{target}}}}"
metric_list:
  - metric: word_perplexity
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The EOS-first checkpoint (with tokenizer), its HF export and a PEFT adapter for it."""
    root = tmp_path_factory.mktemp("eos-first")
    tokenizer = train_tiny_tokenizer(root)
    model = build_model(CONFIG, seed=0)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        # Dimension 0 of the residual stream is large and positive at every position, and EOS's
        # output row reads it: EOS is the argmax after any context (checked below).
        model.tok_embeddings.weight[:, 0] += 3.0
        model.output.weight[tokenizer.eos_id, 0] = 2.5
    ckpt = save_checkpoint(root / "ckpt", model, tokenizer=root / "tokenizer.model")
    export_hf(ckpt, root / "hf")
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    pm = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(root / "hf"),
        peft.LoraConfig(r=4, lora_alpha=16, target_modules=PEFT_TARGETS,
                        init_lora_weights=False, task_type="CAUSAL_LM"))
    pm.save_pretrained(root / "peft")
    return dict(ckpt=ckpt, tokenizer=tokenizer, hf=hf, peft=root / "peft", pm=pm.eval())


@pytest.fixture(scope="module")
def url(world):
    lora = LoRAServing(checkpoint=str(world["ckpt"]),
                       reader=functools.partial(read_any_adapter, base_checkpoint=world["ckpt"]))
    runner = ModelRunner(load_checkpoint(world["ckpt"]), 4, None, kv=KV, lora=lora)
    with LLMEngine(LocalExecutor(runner), world["tokenizer"], kv=KV, seed=0) as engine:
        engine.load_adapter("pf", world["peft"])
        with running_server(create_app(engine, model_name="tessera")) as port:
            yield f"http://127.0.0.1:{port}"


def _evaluate(url: str, model: str, tmp_path: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    (tmp_path / "eos_mc.yaml").write_text(MC_TASK)
    (tmp_path / "eos_rolling.yaml").write_text(ROLLING_TASK)
    return simple_evaluate(
        model="local-completions",
        model_args=f"model={model},base_url={url}/v1/completions,tokenizer_backend=remote,"
                   "tokenized_requests=True,num_concurrent=1,max_retries=1",
        tasks=["eos_mc", "eos_rolling"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True, num_fewshot=0, random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0)["samples"]


@torch.no_grad()
def _score(forward, context: list[int], continuation: list[int]) -> tuple[float, int]:
    """(log-likelihood of `continuation` after `context`, the greedy token after both)."""
    ids = context + continuation
    logp = forward(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return (sum(float(logp[len(context) + i - 1, t]) for i, t in enumerate(continuation)),
            int(logp[-1].argmax()))


@pytest.mark.parametrize("served", ["tessera", "pf"])
def test_lm_eval_loglikelihoods_equal_the_reference_when_eos_comes_next(world, url, served,
                                                                       tmp_path):
    tokenizer = world["tokenizer"]
    forward = world["hf"] if served == "tessera" else world["pm"]
    samples = _evaluate(url, served, tmp_path)
    checked, adapter_effect = 0, 0.0
    for sample in samples["eos_mc"]:
        for (context, choice), resp in zip(sample["arguments"], sample["resps"]):
            # lm-eval's split: the context alone, then the rest of context + choice.
            whole, ctx = tokenizer.encode(context + choice), tokenizer.encode(context)
            expected, next_token = _score(forward, ctx, whole[len(ctx):])
            assert next_token == tokenizer.eos_id, (context, choice)  # the request ends on EOS
            adapter_effect = max(adapter_effect,
                                 abs(expected - _score(world["hf"], ctx, whole[len(ctx):])[0]))
            assert abs(resp[0][0] - expected) < 1e-4, (served, context, choice, resp, expected)
            checked += 1
    assert checked == 12
    assert (adapter_effect > 0.1) == (served == "pf")  # the adapter changes the scores
    # Rolling: one window per (short) document, scored after lm-eval's prefix token (BOS).
    for sample in samples["eos_rolling"]:
        (text,) = sample["arguments"][0][:1]
        ids = tokenizer.encode(text)
        expected, next_token = _score(forward, [tokenizer.bos_id], ids)
        assert next_token == tokenizer.eos_id
        got = sample["resps"][0][0]
        got = got[0] if isinstance(got, (tuple, list)) else got
        assert abs(got - expected) < 1e-4, (served, text, got, expected)
        checked += 1
    assert checked > 12
