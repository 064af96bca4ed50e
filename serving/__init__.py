"""Serving: the generation engine (`serving.engine`), its HTTP surface (`serving.http`), and the
`tessera serve` / `tessera generate` commands (`serving.cli`, `serving.generate`).

`serving.types` is the contract between the two halves: the HTTP dialects turn requests into
`GenerationRequest`s for an `Engine` and stream its `GenerationOutput`s back.
"""
