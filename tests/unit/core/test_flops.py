"""The FLOP count behind every MFU figure, against the closed form in the Megatron paper."""

from tessera.core import ModelConfig
from tessera.core.flops import model_flops_per_token


def test_gpt2_matches_megatron_closed_form():
    # Narayanan et al. (2021), eq. 3, per token: 72 L h^2 (1 + s / 6h + V / 12 L h) for a GPT
    # with a 4h MLP and a tied output layer (biases and norms not counted).
    config = ModelConfig.from_name("gpt2-124m")
    L, h, V, s = config.num_layers, config.hidden_size, config.vocab_size, 1024
    megatron = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert abs(model_flops_per_token(config, s) / megatron - 1) < 1e-12


def test_untied_llama_counts_output_layer_not_embedding_lookup():
    tied = ModelConfig.from_name("llama-tiny", tied_embeddings=True)
    untied = ModelConfig.from_name("llama-tiny", tied_embeddings=False)
    assert model_flops_per_token(tied, 128) == model_flops_per_token(untied, 128)
