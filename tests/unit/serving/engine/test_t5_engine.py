"""A converted T5 answers through the OpenAI completions route and Triton's generate with HF
`generate`'s greedy output (text with sentinels in and out), and the thin T5 engine refuses
what it cannot do."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastapi.testclient import TestClient  # noqa: E402

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.core.models.t5.tokens import SentinelTokenizer  # noqa: E402
from tessera.core.tokenizer import train_tokenizer  # noqa: E402
from tessera.serving.cli import build_parser, served_names  # noqa: E402
from tessera.serving.engine.t5_engine import T5Engine  # noqa: E402
from tessera.serving.http.app import create_app  # noqa: E402
from tessera.serving.http.family_apps import app_for_family, t5_sentinels  # noqa: E402

SENTINELS = 20
PROMPT = "the cat sees <extra_id_0> moon and <extra_id_1>"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("t5serve")
    words = "the cat sees a moon and river stone dog finds bread over under".split()
    gen = torch.Generator().manual_seed(0)
    texts = [" ".join(words[i] for i in torch.randint(0, len(words), (10,), generator=gen))
             for _ in range(200)]
    base = train_tokenizer([], 300, tmp / "tok.model", texts=texts, num_threads=1)
    tok = SentinelTokenizer(base, SENTINELS)
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=tok.vocab_size, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=tok.eos_id)
    hf = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(torch.randn(tok.vocab_size, 32))
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp / "hf")
    (tmp / "hf" / "tokenizer.model").write_bytes((tmp / "tok.model").read_bytes())
    import_hf(tmp / "hf", tmp / "t5")
    engine = T5Engine.from_checkpoint(tmp / "t5", num_sentinels=SENTINELS, model_name="t5")
    with TestClient(create_app(engine, model_name="t5")) as client:
        yield client, hf.eval(), tok, tmp / "t5"


def test_completion_is_hf_greedy_generate(served):
    client, hf, tok, _ = served
    ids = tok.encode(PROMPT, eos=True)
    assert tok.decode(ids[:-1]) == PROMPT  # sentinels survive the round trip as text
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                           num_beams=1, eos_token_id=tok.eos_id, pad_token_id=0)[0, 1:].tolist()
    if tok.eos_id in want:
        want = want[: want.index(tok.eos_id)]
    r = client.post("/v1/completions", json={"model": "t5", "prompt": PROMPT, "max_tokens": 8,
                                              "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == tok.decode(want)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == len(want) > 0
    r = client.post("/v2/models/t5/generate", json={"text_input": PROMPT, "max_tokens": 8,
                                                     "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == tok.decode(want)  # Triton's generate extension too


def test_sampling_requests_are_refused_clearly(served):
    client = served[0]
    r = client.post("/v1/completions", json={"model": "t5", "prompt": "the cat", "max_tokens": 4,
                                              "temperature": 0.7})
    assert r.status_code == 400 and "decodes greedily: set temperature 0" in r.text


def test_tessera_serve_picks_the_t5_engine_with_the_sentinels_the_vocabulary_holds(served):
    client, _, _, checkpoint = served
    args = build_parser().parse_args(["--checkpoint", str(checkpoint), "--api-key", "k"])
    app = app_for_family(args, served_names(args))
    body = {"model": "tessera", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    with TestClient(app) as cli:
        assert cli.post("/v1/completions", json=body).status_code == 401
        r = cli.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"})
    want = client.post("/v1/completions", json={**body, "model": "t5"}).json()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert t5_sentinels(320, 300, None) == 20 and t5_sentinels(32128, 32000, None) == 100
    with pytest.raises(ValueError, match="room for 20"):
        t5_sentinels(320, 300, 21)
