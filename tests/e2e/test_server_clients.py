"""A real server (uvicorn, tiny random-weight model, real engine) driven by real clients.

NVIDIA's `tritonclient` (sync and aio), the `openai` SDK, httpx for the generate extension, the
Megatron `/api`, metrics and errors, Tessera's own client and CLI, the `triton_example` script,
and a load test: 200 requests from 32 concurrent clients against an admission limit of 8, each
answered in full or with 429/503, none lost, none hanging, the server's memory flat over rounds.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import psutil
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from tritonclient.utils import InferenceServerException

from tessera.__main__ import generate as generate_cli
from tessera.clients import AsyncClient, Client, TesseraError

from .conftest import API_KEY, ROOT, free_port

pytestmark = pytest.mark.timeout(120)


def _input(name: str, value: np.ndarray, datatype: str, binary: bool = True):
    t = triton.InferInput(name, list(value.shape), datatype)
    t.set_data_from_numpy(value, binary_data=binary)
    return t


def _prompt_inputs(binary: bool, prompts=("The cat", "héllo ✓"), max_tokens=4):
    text = np.array([[p.encode()] for p in prompts], dtype=np.object_)
    lengths = np.full((len(prompts), 1), max_tokens, dtype=np.int32)
    return [_input("text_input", text, "BYTES", binary),
            _input("max_tokens", lengths, "INT32", binary),
            _input("min_length", lengths, "INT32", binary),
            _input("temperature", np.zeros((len(prompts), 1), dtype=np.float32), "FP32", binary)]


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_tritonclient_sync(server):
    client = triton.InferenceServerClient(server.host_port)
    auth = server.auth  # NOTE: tritonclient's infer writes into the headers dict it is given
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("ensemble", headers=auth)
        assert client.is_model_ready("tiny", "1", headers=auth)
        assert not client.is_model_ready("nope", headers=auth)
        assert "generate" in client.get_server_metadata(headers=auth)["extensions"]
        meta = client.get_model_metadata("ensemble", headers=auth)
        assert meta["name"] == "ensemble" and any(i["name"] == "text_input" for i in meta["inputs"])
        config = client.get_model_config("tiny", headers=auth)
        assert config["max_batch_size"] == 8
        index = client.get_model_repository_index(headers=auth)
        assert {"name": "tiny", "version": "1", "state": "READY"} in index
        assert any(e["name"] == "tiny:qa" for e in index) == server.real or not server.real

        for binary in (True, False):
            outputs = [triton.InferRequestedOutput("text_output", binary_data=binary)]
            result = client.infer("ensemble", _prompt_inputs(binary), outputs=outputs,
                                  request_id="r-1", headers=server.auth)
            texts = result.as_numpy("text_output").ravel()
            assert texts.shape == (2,) and result.get_response()["id"] == "r-1"
            assert all(isinstance(t, bytes if binary else str) for t in texts)
        # default outputs (binary), gzip both ways, explicit version
        result = client.infer("tiny", _prompt_inputs(True), model_version="1", headers=server.auth,
                              request_compression_algorithm="gzip",
                              response_compression_algorithm="gzip")
        assert len(result.as_numpy("text_output")) == 2
        with pytest.raises(InferenceServerException) as err:
            client.infer("nope", _prompt_inputs(True), headers=server.auth)
        assert err.value.status() == "404" and "unknown model 'nope'" in err.value.message()
        with pytest.raises(InferenceServerException) as err:
            client.get_server_metadata()  # no API key
        assert err.value.status() == "401"
    finally:
        client.close()


def test_tritonclient_aio(server):
    async def main():
        client = triton_aio.InferenceServerClient(server.host_port)
        try:
            assert await client.is_server_ready()
            assert await client.is_model_ready("ensemble", headers=server.auth)
            meta = await client.get_model_metadata("tiny", headers=server.auth)
            assert meta["versions"] == ["1"]
            results = await asyncio.gather(*[
                client.infer("ensemble", _prompt_inputs(i % 2 == 0), headers=server.auth)
                for i in range(4)])  # 4 x 2 rows: exactly the 8 admission slots
            assert all(r.as_numpy("text_output").shape == (2, 1) for r in results)
        finally:
            await client.close()

    asyncio.run(main())


def test_generate_extension_over_httpx(server):
    url = f"{server.url}/v2/models/ensemble"
    with httpx.Client(headers=server.auth, timeout=30) as http:
        r = http.post(f"{url}/generate", json={"text_input": "The cat", "max_tokens": 5,
                                               "min_length": 5, "temperature": 0.0,
                                               "return_log_probs": True})
        body = r.json()
        assert r.status_code == 200 and body["model_name"] == "ensemble"
        assert len(body["output_log_probs"]) == 5
        assert body["cum_log_probs"] == pytest.approx(sum(body["output_log_probs"]), rel=1e-5)
        events = []
        with http.stream("POST", f"{url}/generate_stream", json={
                "text_input": "The cat", "parameters": {"max_tokens": 5, "min_length": 5,
                                                        "temperature": 0.0}}) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
        assert "".join(e["text_output"] for e in events) == body["text_output"]
        r = http.post(f"{url}/generate", json={"text_input": "x", "max_tokens": -2})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]


def test_openai_sdk(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    models = [m.id for m in client.models.list()]
    assert models[0] == "tiny" and (("tiny:qa" in models) or not server.real)
    done = client.completions.create(model="tiny", prompt="The cat", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 6 and done.choices[0].finish_reason == "length"
    stream = client.completions.create(model="tiny", prompt="The cat", max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    several = client.completions.create(model="tiny", prompt="The cat", max_tokens=4, n=3, seed=5,
                                        temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in several.choices) == [0, 1, 2]
    scored = client.completions.create(model="tiny", prompt="The cat", max_tokens=2, echo=True,
                                       logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    choice = scored.choices[0]
    assert choice.text.startswith("The cat")
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) > 2
    # At most logprobs + 1 entries: the chosen token is always listed (as OpenAI's API does).
    assert all(1 <= len(t) <= 3 for t in choice.logprobs.top_logprobs[1:])
    if server.real:
        task = client.completions.create(model="tiny:qa", prompt="The cat", max_tokens=3)
        assert task.model == "tiny:qa"
    chat = client.chat.completions.create(model="tiny", max_tokens=5, temperature=0, logprobs=True,
                                          messages=[{"role": "user", "content": "Hello"}])
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].logprobs.content
    pieces = client.chat.completions.create(model="tiny", max_tokens=5, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "Hello"}])
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == \
        chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=10**9)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_dialects_agree_on_greedy_text_and_megatron_api(server):
    with httpx.Client(headers=server.auth, timeout=30) as http:
        openai_text = http.post(f"{server.url}/v1/completions", json={
            "prompt": "The river", "max_tokens": 6, "temperature": 0}).json()["choices"][0]["text"]
        triton_text = http.post(f"{server.url}/v2/models/tiny/generate", json={
            "text_input": "The river", "max_tokens": 6, "temperature": 0}).json()["text_output"]
        r = http.put(f"{server.url}/api", json={"prompts": ["The river"], "tokens_to_generate": 6,
                                                "temperature": 0, "logprobs": True})
        assert r.status_code == 200, r.text
        api = r.json()
        assert openai_text == triton_text == api["text"][0][len("The river"):]
        assert len(api["logprobs"][0]) == len(api["segments"][0]) - 1
        r = http.put(f"{server.url}/api", json={"prompts": "x"})
        assert r.status_code == 400 and "prompts" in r.json()["error"]


@pytest.mark.parametrize("content, fragment", [
    (b'{"prompt": "x", "max_tokens": ', "not valid JSON"),
    (b'{"prompt": "\xc3\x28"}', "UTF-8"),
    (b'{"prompt": "x", "max_tokens": -5}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
    (b'{"prompt": {"a": 1}}', "prompt"),
    (b'{"prompt": "x", "model": "tiny:nope"}', "unknown task"),
])
def test_malformed_requests_get_4xx_with_a_message(server, content, fragment):
    r = httpx.post(f"{server.url}/v1/completions", content=content, headers=server.auth, timeout=30)
    assert 400 <= r.status_code < 500 and fragment in r.json()["error"]["message"], r.text


def test_health_is_open_and_metrics_count(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/docs").status_code == 401
    httpx.post(f"{server.url}/v1/completions", headers=server.auth, timeout=30,
               json={"prompt": "a", "max_tokens": 2})
    text = httpx.get(f"{server.url}/metrics", headers=server.auth).text
    for name in ("tessera:num_requests_running", "tessera:num_requests_waiting",
                 "tessera:kv_cache_usage_perc"):
        assert name in text
    assert _metric(text, "tessera:time_to_first_token_seconds_count") >= 1
    assert _metric(text, "tessera:generation_tokens_total") >= 2
    assert _metric(text, "tessera:requests_total", dialect="openai") >= 1


def test_client_disconnect_mid_stream_aborts_the_request(server):
    def aborted() -> float:
        text = httpx.get(f"{server.url}/metrics", headers=server.auth).text
        return _metric(text, "tessera:requests_total", dialect="openai", status="abort")

    before = aborted()
    with httpx.Client(headers=server.auth, timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json={
                "prompt": "SLOW cat", "max_tokens": 240, "stream": True,  # (SLOW: for the fake)
                "ignore_eos": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data:")
    deadline = time.monotonic() + 10
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted() == before + 1
    text = httpx.get(f"{server.url}/metrics", headers=server.auth).text
    if server.real:
        assert _metric(text, "tessera:engine_requests_finished_abort_total") >= 1


def test_tessera_client_and_cli(server, capsys):
    with Client(server.url, api_key=API_KEY) as client:
        assert client.health() and client.models()[0].id == "tiny"
        answer = client.generate("The cat", max_tokens=4, temperature=0, ignore_eos=True)
        assert answer.usage.completion_tokens == 4
        streamed = "".join(c.text for c in client.stream("The cat", max_tokens=4, temperature=0,
                                                         ignore_eos=True))
        assert streamed == answer.text
        with pytest.raises(TesseraError) as err:
            client.generate("x", model="nope")
        assert err.value.status == 404

    async def run_async():
        async with AsyncClient(server.url, api_key=API_KEY) as client:
            answers = await asyncio.gather(*[client.generate("The cat", max_tokens=3, temperature=0)
                                             for _ in range(5)])
            return {a.text for a in answers}

    assert len(asyncio.run(run_async())) == 1  # greedy: one answer, whatever the batching
    with Client(server.url, api_key=API_KEY) as client:
        expected = client.generate("The cat", max_tokens=4, temperature=0).text
    assert generate_cli(["The cat", "--url", server.url, "--api-key", API_KEY,
                         "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out == f"The cat{expected}\n"
    assert generate_cli(["x", "--url", server.url, "--api-key", "wrong"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "401 missing or wrong API key" in captured.err


def test_triton_example_script(server):
    done = subprocess.run([sys.executable, "-m", "tessera.clients.triton_example", "--url",
                           server.host_port, "--api-key", API_KEY, "--max-tokens", "4", "The cat"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The cat")


async def _load_round(url: str, n_requests: int, n_clients: int) -> dict[str, int]:
    """`n_requests` completions from `n_clients` concurrent workers; counts by outcome."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(i)
    counts = {"ok": 0, "busy": 0, "other": 0}

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            stream = i % 2 == 0
            body = {"prompt": f"request {i}", "max_tokens": 8, "ignore_eos": True, "stream": stream}
            r = await http.post("/v1/completions", json=body)
            if r.status_code in (429, 503):
                counts["busy"] += 1
                assert "retry-after" in r.headers
            elif r.status_code == 200 and stream and r.text.rstrip().endswith("data: [DONE]"):
                counts["ok"] += 1
            elif r.status_code == 200 and not stream and r.json()["usage"]["completion_tokens"] == 8:
                counts["ok"] += 1
            else:
                counts["other"] += 1

    # keepalive_expiry below the server's keep-alive timeout (uvicorn: 5 s): with both at 5 s
    # (httpx's default), a worker starved for 5 s on a loaded machine can send its next request
    # on a connection the server is closing at that moment, a ReadError that is not the server's.
    limits = httpx.Limits(max_connections=n_clients, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=60, limits=limits) as http:
        await asyncio.wait_for(asyncio.gather(*[worker(http) for _ in range(n_clients)]), timeout=60)
    return counts


def test_load_is_answered_in_full_or_refused_and_memory_stays_flat(server):
    process = psutil.Process(server.process.pid)
    rss, rounds = [], []
    for _ in range(3):
        counts = asyncio.run(_load_round(server.url, 200, 32))
        rounds.append(counts)
        rss.append(process.memory_info().rss)
    for counts in rounds:
        assert counts["other"] == 0 and counts["ok"] + counts["busy"] == 200, rounds
        assert counts["ok"] > 0
    assert sum(c["busy"] for c in rounds) > 0  # 32 clients against 8 slots: some were refused
    growth = rss[-1] - rss[0]
    print(f"\nload: {rounds}; server RSS after each round: {[round(r / 2**20, 1) for r in rss]} MiB")
    assert growth < max(0.10 * rss[0], 30 * 2**20), rss
    text = httpx.get(f"{server.url}/metrics", headers=server.auth).text
    assert _metric(text, "tessera:num_requests_admitted") == 0
    assert _metric(text, "tessera:num_requests_running") == 0


def test_generate_cli_local_mode_still_works(tiny_checkpoint, capsys):
    assert generate_cli(["The cat", "--checkpoint", str(tiny_checkpoint), "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("The cat")
    with pytest.raises(SystemExit):
        generate_cli(["x", "--checkpoint", str(tiny_checkpoint), "--url", "http://127.0.0.1:1"])


def test_tessera_serve_command_serves_this_app(tiny_checkpoint):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tessera", "serve", "--checkpoint",
                                str(tiny_checkpoint), "--port", str(port), "--api-key", "k",
                                "--log-level", "warning"], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        with Client(url, api_key="k", max_retries=0) as client:
            deadline = time.monotonic() + 60
            while not client.health():
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
            # Served as the README's "tessera", and under the checkpoint directory's name.
            assert client.models()[0].id == "tessera"
            assert client.generate("The cat", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
            assert client.generate("The cat", model="tiny", max_tokens=1).model == "tiny"
        assert httpx.get(f"{url}/v1/models").status_code == 401
    finally:
        process.terminate()
        process.wait(timeout=30)
