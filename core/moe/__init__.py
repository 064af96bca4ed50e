"""Mixture-of-Experts pieces: token permutation (here first), router, experts, layer."""
