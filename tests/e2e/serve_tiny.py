"""A server process for the end-to-end tests: a tiny random-weight model behind `create_app`.

    python -m tests.e2e.serve_tiny --checkpoint DIR --port 8123 --api-key K --max-concurrency 8

Serves the real `LLMEngine` (with one random prompt-tuned task, `qa`), or `--fake` the
deterministic fake engine of the unit tests.
"""

from __future__ import annotations

import argparse

import torch
import uvicorn

from tessera.serving.http.app import create_app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--fake", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)  # leave the other core to the test's clients
    if args.fake:
        from tests.unit.serving.fake_engine import FakeEngine

        engine = FakeEngine(tasks=("qa",))
    else:
        from tessera.core.checkpoint import read_manifest
        from tessera.serving.engine import LLMEngine

        hidden = read_manifest(args.checkpoint).model.hidden_size
        table = torch.randn(4, hidden, generator=torch.Generator().manual_seed(0)) * 0.02
        engine = LLMEngine.from_checkpoint(args.checkpoint, model_name="tiny", tasks={"qa": table},
                                           max_batch=args.max_batch, seed=0)
    app = create_app(engine, model_name="tiny", api_key=args.api_key,
                     max_concurrency=args.max_concurrency, request_timeout_s=60)
    try:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()


if __name__ == "__main__":
    main()
