"""BERT, the bidirectional post-LayerNorm encoder with a masked-LM head: model, config checks,
sharding."""
