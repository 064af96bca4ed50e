"""Per-request LoRA serving, against references nobody here wrote.

A tiny random Llama base (GQA, SwiGLU) is exported to Hugging Face; one adapter is made with
`peft` on that export (random nonzero B, `init_lora_weights=False`, plus two Adam steps) and
served from its PEFT directory, another is a Tessera adapter. References: for the PEFT adapter,
transformers running peft's own `merge_and_unload()` model; for the Tessera one, Tessera's model
with the adapter merged into its weights (`merge_into`); for plain requests, the base. Greedy
continuations by argmax of the full forward pass, with the chosen tokens' logprobs.
"""

from __future__ import annotations

import functools

import httpx
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
openai = pytest.importorskip("openai")
triton = pytest.importorskip("tritonclient.http")

import uvicorn  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tessera.converters.hf_io import export_hf  # noqa: E402
from tessera.converters.peft_lora import read_any_adapter  # noqa: E402
from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.core.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from tessera.core.fingerprint import base_fingerprint  # noqa: E402
from tessera.core.lora_format import (  # noqa: E402
    AdapterConfig,
    AdapterError,
    load_adapter,
    lora_names,
    merge_into,
    save_adapter,
)
from tessera.core.parallel.sharding import global_param_shapes  # noqa: E402
from tessera.serving.engine import LLMEngine  # noqa: E402
from tessera.serving.engine.adapters import AdapterBusy, AdapterRegistry, LoRAServing  # noqa: E402
from tessera.serving.engine.executor import LocalExecutor  # noqa: E402
from tessera.serving.engine.kv_config import KVCacheConfig  # noqa: E402
from tessera.serving.engine.runner import ModelRunner  # noqa: E402
from tessera.serving.engine.speculative import SpeculativeConfig  # noqa: E402
from tessera.serving.http.app import create_app  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.serving_helper import collect, running_server, train_tiny_tokenizer  # noqa: E402

VOCAB = 512
CONFIG = ModelConfig(name="lora-serve", vocab_size=VOCAB, hidden_size=64, num_layers=2,
                     num_heads=8, num_kv_heads=4, ffn_hidden_size=96, max_position_embeddings=96)
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KV = KVCacheConfig(kind="paged", block_size=8)
N_NEW = 6
API_KEY = "lora-key"


# ------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Base checkpoint (with tokenizer), its HF export, a PEFT adapter dir, two Tessera ones."""
    root = tmp_path_factory.mktemp("lora-serve")
    tokenizer = train_tiny_tokenizer(root)
    model = build_model(CONFIG, seed=0)
    with torch.no_grad():  # norms away from 1, so nothing is trivially symmetric
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ckpt = save_checkpoint(root / "ckpt", model, tokenizer=root / "tokenizer.model")
    export_hf(ckpt, root / "hf")
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf")
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=16, target_modules=PEFT_TARGETS,
                                                 init_lora_weights=False, task_type="CAUSAL_LM"))
    optimizer = torch.optim.Adam([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        optimizer.zero_grad()
        pm(ids, labels=ids).loss.backward()
        optimizer.step()
    pm.save_pretrained(root / "peft")
    return dict(root=root, ckpt=ckpt, tokenizer=tokenizer, hf=root / "hf", peft=root / "peft",
                peft_merged=pm.eval().merge_and_unload().eval(),
                nat=_native_adapter(ckpt, root / "nat", seed=5),
                nat2=_native_adapter(ckpt, root / "nat2", seed=6))


def _native_adapter(ckpt, out, seed: int):
    """A Tessera adapter on qkv and w2 of every layer, module ranks 4 and 8, B nonzero."""
    shapes, g = global_param_shapes(CONFIG), torch.Generator().manual_seed(seed)
    modules, tensors = [], {}
    for i in range(CONFIG.num_layers):
        for leaf, r in (("attention.wqkv", 4), ("feed_forward.w2", 8)):
            module = f"layers.{i}.{leaf}"
            out_f, in_f = shapes[f"{module}.weight"]
            a, b = lora_names(module)
            tensors[a] = torch.randn(r, in_f, generator=g) / in_f ** 0.5
            tensors[b] = torch.randn(out_f, r, generator=g) * 0.3
            modules.append(module)
    config = AdapterConfig(rank=4, alpha=8.0, modules=tuple(modules),
                           base_fingerprint=base_fingerprint(ckpt))
    return save_adapter(out, config, tensors)


def _lora(world, **kwargs) -> LoRAServing:
    return LoRAServing(checkpoint=str(world["ckpt"]),
                       reader=functools.partial(read_any_adapter,
                                                base_checkpoint=world["ckpt"]), **kwargs)


def _engine(world, tasks=None, speculative=None, **lora_kwargs) -> LLMEngine:
    runner = ModelRunner(load_checkpoint(world["ckpt"]), 4, tasks, kv=KV,
                         lora=_lora(world, **lora_kwargs))
    return LLMEngine(LocalExecutor(runner), world["tokenizer"], kv=KV, seed=0,
                     speculative=speculative)


# ----------------------------------------------------------------------------- references


@torch.no_grad()
def _greedy(forward, prompt: list[int], n: int = N_NEW) -> tuple[list[int], list[float]]:
    """Argmax continuation of `forward(ids (1, T)) -> logits (1, T, V)` and its logprobs."""
    ids, lps = list(prompt), []
    for _ in range(n):
        logp = forward(torch.tensor([ids]))[0, -1].float().log_softmax(-1)
        ids.append(int(logp.argmax()))
        lps.append(float(logp[ids[-1]]))
    return ids[len(prompt):], lps


@functools.cache
def _tessera(ckpt, adapter=None):
    model = load_checkpoint(ckpt).eval()
    if adapter is not None:
        config, tensors = load_adapter(adapter)
        model.load_state_dict(merge_into(dict(model.state_dict()), config, tensors))
    return model


def _reference(world, which: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    if which == "pf":
        return _greedy(lambda ids: world["peft_merged"](ids).logits, prompt)
    return _greedy(_tessera(world["ckpt"], world[which] if which != "base" else None), prompt)


def _prompt(seed: int, n: int = 21) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _req(rid, prompt, adapter=None, task=None) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=N_NEW, temperature=0,
                                                         ignore_eos=True, logprobs=0),
                             task=task, adapter=adapter)


# ------------------------------------------------------------------ one batch, merged parity


def test_two_adapters_a_task_and_plain_requests_in_one_batch_equal_their_merged_models(world):
    task_table = torch.randn(3, CONFIG.hidden_size, generator=torch.Generator().manual_seed(9))
    engine = _engine(world, tasks={"qa": task_table},
                     preload=(("pf", str(world["peft"])), ("nat", str(world["nat"]))))
    batches = []
    run = engine.executor.run
    engine.executor.run = lambda batch: (batches.append(batch.adapters), run(batch))[1]
    prompts = [_prompt(1), _prompt(2, 13), _prompt(3, 30)]
    with engine:
        mixed = collect(engine, [_req("pf", prompts[0], "pf"), _req("nat", prompts[1], "nat"),
                                 _req("plain", prompts[2]),
                                 _req("task", prompts[1], "nat", task="qa")])
        task_alone = collect(engine, [_req("t", prompts[1], "nat", task="qa")])[0]
    # One forward pass held every kind of row: both adapters' slots and a plain row (-1).
    assert any(b is not None and {-1, 0, 1} <= set(b.tolist()) for b in batches), batches
    for result, which, prompt in zip(mixed, ("pf", "nat", "base"), prompts):
        want_ids, want_lps = _reference(world, which, prompt)
        assert result.token_ids == want_ids, which
        diff = max(abs(a.logprob - b) for a, b in zip(result.logprobs, want_lps))
        assert diff < 1e-4, (which, diff)
    # The adapters change the answer (else this test could not fail)...
    assert _reference(world, "base", prompts[0])[0] != mixed[0].token_ids
    assert _reference(world, "base", prompts[1])[0] != mixed[1].token_ids
    # ...and a tasked request with an adapter is the same batched with others as alone.
    assert mixed[3].token_ids == task_alone.token_ids


def test_speculative_rows_are_verified_with_their_own_adapter(world):
    """Prompt-lookup drafts are checked by the target with the request's adapter applied: the
    outputs stay each merged model's greedy continuation (a verification pass that dropped the
    adapter rows would turn them into the base model's)."""
    engine = _engine(world, preload=(("pf", str(world["peft"])), ("nat", str(world["nat"]))),
                     speculative=SpeculativeConfig("ngram", num_speculative_tokens=3))
    # Repeated passages, so prompt lookup has something to propose at every step.
    prompts = [_prompt(7, 8) * 3, _prompt(8, 7) * 3, _prompt(9, 9) * 2]
    with engine:
        got = collect(engine, [_req("pf", prompts[0], "pf"), _req("nat", prompts[1], "nat"),
                               _req("plain", prompts[2])])
        stats = engine.stats()
    assert stats["spec_draft_tokens_total"] > 0
    for result, which, prompt in zip(got, ("pf", "nat", "base"), prompts):
        assert result.token_ids == _reference(world, which, prompt)[0], which
        if which != "base":  # the adapter matters here, so the check above can fail
            assert result.token_ids != _reference(world, "base", prompt)[0], which


def test_registry_limits_names_ranks_and_refuses_to_unload_in_use(world):
    model = load_checkpoint(world["ckpt"])
    registry = AdapterRegistry([model], _lora(world, max_loras=1, max_rank=8))
    with pytest.raises(AdapterError, match="--max-lora-rank 12"):  # PEFT qkv: 3 x r=4
        registry.load("pf", world["peft"])
    ident = registry.load("nat", world["nat"])
    with pytest.raises(AdapterBusy, match="already loaded"):
        registry.load("nat", world["nat2"])
    with pytest.raises(AdapterError, match="not allowed"):
        registry.load("a:b", world["nat2"])
    with pytest.raises(AdapterBusy, match="slots are taken"):
        registry.load("other", world["nat2"])

    class User:
        finished = False

    user = User()
    assert registry.acquire("nat", user) == (0, ident)
    with pytest.raises(AdapterBusy, match="in use by 1"):
        registry.unload("nat")
    user.finished = True
    registry.unload("nat")
    assert registry.names() == [] and registry.load("nat", world["nat2"]) != ident
    # A foreign base is refused by its fingerprint.
    other = save_checkpoint(world["root"] / "other", build_model(CONFIG, seed=1))
    foreign = LoRAServing(checkpoint=str(other), max_loras=1)
    with pytest.raises(AdapterError, match="only works on the model it was tuned on"):
        AdapterRegistry([load_checkpoint(other)], foreign).load("nat", world["nat"])


# --------------------------------------------------------------------- a real HTTP server


@pytest.fixture(scope="module")
def served(world):
    """A uvicorn server over a LoRA engine with runtime loading on and an API key."""
    with _engine(world, max_loras=2, allow_runtime=True) as engine:
        app = create_app(engine, model_name="tiny", api_key=API_KEY, allow_runtime_lora=True)
        with running_server(app) as port:
            yield engine, f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _complete(url: str, model: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": N_NEW, "temperature": 0,
        "ignore_eos": True, "logprobs": 0})


def _check(world, response: httpx.Response, which: str, prompt: list[int]) -> None:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    want_ids, want_lps = _reference(world, which, prompt)
    # The text continues the prompt's (leading spaces kept); the logprobs pin every token.
    assert choice["text"] in world["tokenizer"].decode(prompt + want_ids), which
    assert len(choice["logprobs"]["token_logprobs"]) == len(want_lps)
    diff = max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], want_lps))
    assert diff < 1e-4, (which, diff)


def _load(url: str, name: str, path, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", headers=headers, timeout=60,
                      json={"lora_name": name, "lora_path": str(path)})


def _unload(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/unload_lora_adapter", headers=AUTH, timeout=60,
                      json={"lora_name": name})


def test_hot_load_and_unload_without_restart_and_the_prefix_cache_keeps_adapters_apart(
        world, served):
    engine, url, _ = served
    prompt = _prompt(7, 40)  # five full 8-token blocks: cached, then looked up
    assert _complete(url, "tiny:nat", prompt).status_code == 404
    assert _load(url, "nat", world["nat"], headers={}).status_code == 401  # behind the key
    assert _load(url, "nat", world["nat"]).status_code == 200
    assert _load(url, "pf", world["peft"]).status_code == 200  # a PEFT directory
    assert _load(url, "third", world["nat2"]).status_code == 409  # --max-loras 2
    models = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]
    assert {"id": "nat", "parent": "tiny"}.items() <= next(m for m in models
                                                          if m["id"] == "nat").items()
    _check(world, _complete(url, "tiny", prompt), "base", prompt)  # caches the base's blocks
    _check(world, _complete(url, "tiny:nat", prompt), "nat", prompt)
    hits = engine.stats()["prefix_cache_hits_tokens_total"]
    _check(world, _complete(url, "nat", prompt), "nat", prompt)  # its own blocks: a hit
    assert engine.stats()["prefix_cache_hits_tokens_total"] > hits
    _check(world, _complete(url, "tiny:pf", prompt), "pf", prompt)
    # Reloaded under the same name with other weights: never the old adapter's KV blocks.
    assert _unload(url, "nat").status_code == 200
    assert _complete(url, "tiny:nat", prompt).status_code == 404
    assert _unload(url, "nat").status_code == 404
    assert _load(url, "nat", world["nat2"]).status_code == 200
    _check(world, _complete(url, "tiny:nat", prompt), "nat2", prompt)
    metrics = httpx.get(f"{url}/metrics", headers=AUTH).text
    assert "tessera:lora_adapters_loaded 2.0" in metrics
    assert 'served_model="tiny:nat"} 3.0' in metrics
    for name in ("nat", "pf"):
        assert _unload(url, name).status_code == 200


def test_an_unknown_adapter_is_404_in_every_dialect_through_the_real_clients(served):
    _, url, host_port = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    for model in ("tiny:nope", "nope"):
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=model, prompt="hi", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="tiny:nope", max_tokens=1,
                                       messages=[{"role": "user", "content": "hi"}])
    tc = triton.InferenceServerClient(host_port)
    try:
        text = triton.InferInput("text_input", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b"hi"]], dtype=np.object_))
        with pytest.raises(InferenceServerException) as err:
            tc.infer("tiny:nope", [text], headers=dict(AUTH))
        assert err.value.status() == "404" and "nope" in err.value.message()
    finally:
        tc.close()
    body = {"text_input": "hi", "max_tokens": 1, "adapter": "nope"}
    r = httpx.post(f"{url}/v2/models/tiny/generate", headers=AUTH, json=body)
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = httpx.put(f"{url}/api", headers=AUTH, json={"prompts": ["hi"], "tokens_to_generate": 1,
                                                     "adapter": "nope"})
    assert r.status_code == 404 and "nope" in r.json()["error"]


# ---------------------------------------------------------------------------- tessera serve


def test_tessera_serve_lora_flags_load_peft_and_tessera_adapters(world, monkeypatch, capsys):
    from tessera.__main__ import main

    seen = {}

    def run(server):  # no port: look at the app uvicorn would serve, then stop
        app = server.config.app
        seen.update(names=app.state.service.adapter_names(),
                    runtime=app.state.allow_runtime_lora)
        server.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    ckpt = str(world["ckpt"])
    assert main(["serve", "--checkpoint", ckpt, "--lora", f"pf={world['peft']}",
                 "--lora", f"nat={world['nat']}", "--allow-runtime-lora"]) == 0
    assert seen == {"names": ["nat", "pf"], "runtime": True}
    assert main(["serve", "--checkpoint", ckpt, "--lora", "no-equals-sign"]) == 2
    assert "expected NAME=PATH" in capsys.readouterr().err
    assert main(["serve", "--checkpoint", ckpt, "--lora", f"pf={world['peft']}",
                 "--max-lora-rank", "8"]) == 2
    assert "--max-lora-rank 12" in capsys.readouterr().err
