"""lm-evaluation-harness, unchanged, against the real server (`--model local-completions`),
offline: a multiple-choice task and a generate task read from the JSONL files shipped in
`lm_eval_tasks/`, the tokenizer through the server's `/tokenizer_info`, `/tokenize` and
`/detokenize` (no tokenizer download).

References: the log-likelihood of each choice computed directly from the model's full forward
pass (over the tokens lm-eval builds: context, then the rest of context + choice), to 1e-4; and
each generation against greedy decoding by the full forward pass, cut at the task's stop string.
Skipped where lm-eval (the `eval` extra) is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks read local files; never the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("datasets")


from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.serving.engine import LLMEngine  # noqa: E402
from tessera.serving.http.app import create_app  # noqa: E402
from tests.serving_helper import (  # noqa: E402
    full_forward_greedy,
    running_server,
    train_tiny_tokenizer,
)

TASKS = Path(__file__).parent / "lm_eval_tasks"
MC_TASK = f"""task: tessera_mc
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
GEN_TASK = f"""task: tessera_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {TASKS / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model, tokenizer, base URL) of a real server on a free port."""
    tokenizer = train_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    model = build_model(ModelConfig.from_name("llama-tiny", init_std=0.1), seed=5).eval()
    with LLMEngine(model, tokenizer, max_batch=4, seed=0) as engine:
        app = create_app(engine, model_name="tessera")
        with running_server(app) as port:
            yield model, tokenizer, f"http://127.0.0.1:{port}"


def _loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    with torch.no_grad():
        logp = model(torch.tensor([ids]))[0].float().log_softmax(-1)
    return sum(float(logp[len(context) + i - 1, t]) for i, t in enumerate(continuation))


def test_lm_eval_local_completions_matches_the_model(served, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model, tokenizer, url = served
    (tmp_path / "tessera_mc.yaml").write_text(MC_TASK)
    (tmp_path / "tessera_gen.yaml").write_text(GEN_TASK)
    results = simple_evaluate(
        model="local-completions",
        model_args=f"model=tessera,base_url={url}/v1/completions,tokenizer_backend=remote,"
                   "tokenized_requests=True,num_concurrent=1,max_retries=1",
        tasks=["tessera_mc", "tessera_gen"],
        # include_defaults=False: indexing lm-eval's thousands of built-in tasks takes minutes.
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True, num_fewshot=0, random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0)
    mc = results["samples"]["tessera_mc"]
    assert len(mc) == 4
    checked = 0
    for sample in mc:
        for (context, choice), resp in zip(sample["arguments"], sample["resps"]):
            loglik, _ = resp[0]
            # lm-eval's split: the context alone, then the rest of context + choice.
            whole, ctx = tokenizer.encode(context + choice), tokenizer.encode(context)
            expected = _loglikelihood(model, ctx, whole[len(ctx):])
            assert abs(loglik - expected) < 1e-4, (context, choice, loglik, expected)
            checked += 1
    assert checked == 12
    for sample in results["samples"]["tessera_gen"]:
        prompt = sample["arguments"][0][0]
        got = sample["resps"][0][0]
        ids, _ = full_forward_greedy(model, tokenizer.encode(prompt), 8)
        if tokenizer.eos_id in ids:
            ids = ids[:ids.index(tokenizer.eos_id)]
        assert got == tokenizer.decode(ids).split("\n")[0], (prompt, got)
