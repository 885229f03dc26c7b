"""opt_serving: serve Meta's OPT language models on JAX/Flax, parallelised over Ray."""
from opt_serving.settings import openmp_defaults as _openmp_defaults

__version__ = "0.1.0"
_openmp_defaults()  # before anything loads a libgomp (torch, under transformers' tokenizers): it reads them once
