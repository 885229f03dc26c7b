"""The Flax OPT as one object, `OPTModel`: its config, its params in the runtime layout of the backend they run on
(one device, or sharded on a tensor-parallel mesh) and its steps (prefill, decode, the full forward). generate() is
not here: runner/generate.py's `Generation` runs it for every plan, over the same stages the engine steps.

`get_model` (opt_serving/models.py) is reachable here, where notebooks have always imported it, and so are
`PREFIXES` (spec.py) and `resolve_numpy_folder` (weights.py).
"""
from __future__ import annotations

from opt_serving.backend import Backend
from opt_serving.config import OPTConfig
from opt_serving.model import kv_cache, layout, opt, steps
from opt_serving.model.weights import resolve_numpy_folder  # noqa: F401 (notebooks import it from here)
from opt_serving.parallel.sharding import ShardedOPT
from opt_serving.spec import PREFIXES  # noqa: F401 (notebooks import it from here)


class OPTModel:
    """The Flax OPT on one device or one tensor-parallel mesh: params + config and its steps. Tensor parallelism
    is a layout of the params (parallel/sharding.py), not another model: over params sharded on `mesh`, GSPMD
    partitions the same programs."""

    def __init__(self, cfg: OPTConfig, params, backend: Backend | None = None, weights: str = "float32",
                 mesh=None, plan=None):
        """`params` in the checkpoint's layout; or, with the `backend` they were prepared for, already in
        its runtime layout (a slot runner's, shared: runner/slots.py). `weights`: how the dense layers run
        (Backend.weights): "int8" for model/quantize.py's params, "bfloat16" for float32 params whose
        products run in bfloat16 (get_model decides). `mesh`: the tp mesh sharded params lie on (the engine
        steps below then keep the cache sharded by heads); `plan`: the planner's plan it was built for."""
        self.config, self.mesh, self.plan = cfg, mesh, plan
        self.dtype = opt.param_dtype(params)
        if backend is None:  # q/k/v fused on one device, packed where the backend chosen for them packs
            backend, params = layout.runtime_params(params, weights=weights)
        # the steps (and a runner's stage over this model: runner/generate.py) run these
        self.backend, self.fused_params = backend, params
        self._sharded = None if mesh is None else ShardedOPT(cfg, params, mesh, backend=backend)

    @property
    def params(self):
        """The params in the checkpoint's layout (q_proj / k_proj / v_proj, plain kernels), as a new tree."""
        return layout.checkpoint_params(self.config, self.backend, self.fused_params)

    # the steps over a cache the caller holds (tests, benchmarks; a mesh keeps it sharded by heads)
    def init_cache(self, batch: int, max_len: int):
        if self._sharded is not None:
            return self._sharded.init_cache(batch, max_len)
        return kv_cache.init_cache(self.config, batch, max_len, kv_cache.cache_dtype(self.fused_params, self.backend))

    def prefill(self, cache, input_ids, attention_mask, all_logits=True):
        if self._sharded is not None:
            return self._sharded.prefill(cache, input_ids, attention_mask, all_logits)
        return steps.prefill(self.config, self.fused_params, cache, input_ids, attention_mask,
                             all_logits=all_logits, backend=self.backend)

    def decode(self, cache, tokens, positions, write_index):
        if self._sharded is not None:
            return self._sharded.decode(cache, tokens, positions, write_index)
        return steps.decode(self.config, self.fused_params, cache, tokens, positions, write_index,
                            backend=self.backend)

    def __call__(self, input_ids, attention_mask=None):
        return steps.forward(self.config, self.fused_params, input_ids, attention_mask, self.backend)


def __getattr__(name: str):
    """`from opt_serving.model.wrapper import get_model`, where notebooks have always imported it: the edge's
    get_model (opt_serving/models.py), which builds this module's models, so it is looked up when asked for
    rather than imported here (the model layer imports nothing above it)."""
    if name == "get_model":
        import opt_serving.models
        return opt_serving.models.get_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

