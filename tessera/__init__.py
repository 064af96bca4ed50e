"""Tessera: pretrain, prompt-tune, convert and serve GPT-style language models.

The root package holds only the version and the `tessera` command's verb table; the work lives in
the subpackages `tessera.core`, `tessera.training`, `tessera.tuning`, `tessera.converters`,
`tessera.serving` and `tessera.clients`.
"""

__version__ = "0.1.0"
