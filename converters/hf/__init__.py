"""The Hugging Face mapping of each model family (one module per family) and its registry."""
