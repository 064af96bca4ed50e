"""Query a Tessera server with NVIDIA's own `tritonclient.http`, as any Triton user would.

    python -m tessera.clients.triton_example --url localhost:8000 "The cat"

The server's model takes the TensorRT-LLM `ensemble` inputs (`text_input`, `max_tokens`, ...)
and answers `text_output`; it is reachable as `ensemble` too, so scripts written for a
TensorRT-LLM deployment work unchanged. Needs `pip install "tritonclient[http]"`.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def generate(url: str, prompt: str, *, model: str = "ensemble", max_tokens: int = 32,
             temperature: float = 0.0, api_key: str | None = None) -> str:
    """The server's continuation of `prompt`, via a plain v2 `infer` call."""
    import tritonclient.http as httpclient

    def tensor(name: str, datatype: str, value: np.ndarray) -> httpclient.InferInput:
        t = httpclient.InferInput(name, list(value.shape), datatype)
        t.set_data_from_numpy(value)
        return t

    inputs = [tensor("text_input", "BYTES", np.array([[prompt.encode("utf-8")]], dtype=np.object_)),
              tensor("max_tokens", "INT32", np.array([[max_tokens]], dtype=np.int32)),
              tensor("temperature", "FP32", np.array([[temperature]], dtype=np.float32))]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    client = httpclient.InferenceServerClient(url)
    try:
        result = client.infer(model, inputs, headers=headers,
                              outputs=[httpclient.InferRequestedOutput("text_output")])
    finally:
        client.close()
    return result.as_numpy("text_output").ravel()[0].decode("utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prompt")
    parser.add_argument("--url", default="localhost:8000", help="host:port of the server")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    from tritonclient.utils import InferenceServerException

    try:
        text = generate(args.url, args.prompt, model=args.model, max_tokens=args.max_tokens,
                        temperature=args.temperature, api_key=args.api_key)
    except InferenceServerException as exc:
        print(f"triton_example: the server answered {exc}", file=sys.stderr)
        return 1
    print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
