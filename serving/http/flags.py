"""What the `tessera serve` flags set on an HTTP app: the key, the limits and the aliases."""

from __future__ import annotations

import argparse
from typing import Any


def app_limits(args: argparse.Namespace, served_names: list[str]) -> dict[str, Any]:
    """`create_app`'s keyword arguments that the flags set; `served_names[0]` is the model's
    name, the rest are its aliases."""
    return dict(api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                max_prompt_tokens=args.max_prompt_tokens, max_concurrency=args.max_concurrency,
                request_timeout_s=args.request_timeout, body_timeout_s=args.body_timeout,
                model_aliases=tuple(served_names[1:]))
