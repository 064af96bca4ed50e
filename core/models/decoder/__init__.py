"""The decoder-only transformer (GPT-style) that gpt2, llama, nemotron, qwen3 and the
Mixture-of-Experts families share (`families`), its sharding rules and initialization."""
