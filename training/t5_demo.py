"""The demo's closing samples for a T5 (`tessera pretrain --model t5-tiny` with no data): each
prompt has a masked span (`<extra_id_0>`) that the model fills, greedy, as span corruption
trained it to (`<extra_id_0> the span <extra_id_1> ...`)."""

from __future__ import annotations

from pathlib import Path

import torch

DEMO_T5_PROMPTS = ("Return the <extra_id_0> of the object.",
                   "The default value <extra_id_0> None.")


def print_t5_samples(checkpoint: str, max_new_tokens: int = 16) -> None:
    """Print the model's span fills for `DEMO_T5_PROMPTS` and how to use the checkpoint."""
    from tessera.core.checkpoint import load_checkpoint
    from tessera.core.models.t5.generate import t5_greedy
    from tessera.core.models.t5.tokens import SentinelTokenizer
    from tessera.core.tokenizer import load_tokenizer

    model = load_checkpoint(checkpoint)
    tokenizer = SentinelTokenizer(load_tokenizer(Path(checkpoint)))
    print("\nspan fills (greedy):")
    for prompt in DEMO_T5_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt, eos=True)])
        out = t5_greedy(model, ids, max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_id)
        fill = [i for i in out[0].tolist() if i != tokenizer.eos_id]
        print(f"  {prompt!r} -> {tokenizer.decode(fill)!r}")
    print(f"\ncheckpoint: {checkpoint}\n  evaluate: tessera evaluate --checkpoint {checkpoint} "
          f"--data DATA_PREFIX")
