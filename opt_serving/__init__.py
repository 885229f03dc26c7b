"""opt_serving: serve Meta's OPT language models on JAX/Flax, parallelised over Ray."""
__version__ = "0.1.0"
