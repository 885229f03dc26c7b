"""metaseq FSDP shards / model-parallel parts / singletons and HF folders -> the numpy folder."""
from opt_serving.checkpoint.formats import CheckpointError, Detected, detect, group_shards  # noqa: F401
