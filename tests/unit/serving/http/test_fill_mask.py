"""BERT fill-mask over HTTP (`POST /v1/fill_mask`) against transformers: a random bert-tiny
checkpoint with the tiny corpus's tokenizer is exported to HF, and the route's top-k tokens and
probabilities must be those of HF `BertForMaskedLM` on the same ids; bad requests get a 400
that says why, and `tessera serve` picks this app for a BERT checkpoint."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastapi.testclient import TestClient  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tessera.converters.cli import main as convert  # noqa: E402
from tessera.core.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from tessera.core.config import ModelConfig  # noqa: E402
from tessera.core.init import build_model  # noqa: E402
from tessera.core.tokenizer import load_tokenizer  # noqa: E402
from tessera.serving.cli import build_parser, served_names  # noqa: E402
from tessera.serving.http.family_apps import app_for_family  # noqa: E402
from tessera.serving.http.fill_mask import FillMask, create_fill_mask_app  # noqa: E402


@pytest.fixture(scope="module")
def bert_ckpt(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("fill")
    config = ModelConfig.from_name("bert-tiny", vocab_size=tiny.vocab_size + 4)
    save_checkpoint(root / "ckpt", build_model(config, seed=5), tokenizer=tiny.tokenizer)
    assert convert(["--to", "hf", "--input", str(root / "ckpt"), "--output",
                    str(root / "hf")]) == 0
    return root


def test_fill_mask_route_matches_hf(bert_ckpt, tiny):
    tokenizer = load_tokenizer(tiny.tokenizer)
    fill = FillMask(load_checkpoint(bert_ckpt / "ckpt"), tokenizer, "bert-tiny")
    client = TestClient(create_fill_mask_app(fill, api_key="k"))
    text = "The cat [MASK] the moon. A small dog [MASK] two blue boats."
    auth = {"Authorization": "Bearer k"}
    answer = client.post("/v1/fill_mask", json={"text": text, "top_k": 3}, headers=auth)
    assert answer.status_code == 200, answer.text
    masks = answer.json()["masks"]
    assert len(masks) == 2 and all(len(m) == 3 for m in masks)

    # The exported directory, loaded by hand (cheaper than `from_pretrained`, same tensors).
    hf = transformers.BertForMaskedLM(transformers.BertConfig.from_pretrained(bert_ckpt / "hf"))
    missing, unexpected = hf.load_state_dict(load_file(bert_ckpt / "hf" / "model.safetensors"),
                                             strict=False)
    assert not unexpected and set(missing) <= {"cls.predictions.decoder.weight",
                                               "cls.predictions.decoder.bias"}  # tied copies
    hf.eval()
    ids = torch.tensor([fill.encode(text)])
    with torch.no_grad():
        logits = hf(ids).logits[0]
    logits[:, tiny.vocab_size:] = float("-inf")  # the four specials are never predicted
    probs = logits.softmax(-1)
    for got, pos in zip(masks, (ids[0] == fill.ids.mask).nonzero().flatten().tolist()):
        scores, best = probs[pos].topk(3)
        assert [g["token_id"] for g in got] == best.tolist()
        assert max(abs(g["score"] - s) for g, s in zip(got, scores.tolist())) <= 1e-5
        assert got[0]["token"] == tokenizer.decode([int(best[0])])

    assert client.post("/v1/fill_mask", json={"text": "no mask here"},
                       headers=auth).status_code == 400
    assert "has no [MASK]" in client.post("/v1/fill_mask", json={"text": "x"},
                                          headers=auth).json()["detail"]
    assert client.post("/v1/fill_mask", json={"text": text}).status_code == 401
    assert client.get("/health").status_code == 200


def test_serve_picks_fill_mask_for_bert(bert_ckpt):
    ckpt = str(bert_ckpt / "ckpt")
    args = build_parser().parse_args(["--checkpoint", ckpt, "--served-model-name", "bert"])
    app = app_for_family(args, served_names(args))
    assert app is not None and any(r.path == "/v1/fill_mask" for r in app.routes)
    with TestClient(app) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "bert"
    with pytest.raises(ValueError, match="one process"):
        app_for_family(build_parser().parse_args(["--checkpoint", ckpt, "--tp", "2"]), ["x"])
