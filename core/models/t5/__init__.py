"""T5, the encoder-decoder family: model, layout of its stacks over pipeline stages, sharding,
initialization, pipeline helpers, span corruption and generation."""
