"""How many bytes a pipeline stage holds on each of its devices: its params, their runtime layout, the KV cache of
the caches its plan keeps, the activations of its largest pass, and what loading it passes through. The planner
fits these under each device's memory; kept apart from the search, which only compares them with a limit.
"""
from __future__ import annotations

import dataclasses

from opt_serving.config import DRAFT_WIDTHS, OPTConfig, SpeculativeConfig
from opt_serving.parallel import cost
from opt_serving.runner import prefix


def peak_bytes(params: int, kv: int, act: int, runtime: int = 0, load: int = 0) -> int:
    """A stage's peak on one device: its params in their runtime layout, then the larger of what loading them
    passes through (before any cache exists) and its KV cache with the activations."""
    return params + runtime + max(load, kv + act)


def stage_memory(cfg: OPTConfig, n: int, first: bool, last: bool, tp: int, batch: int,
                 micro: int, max_seq_len: int, prefill_batch: int, dtype: str,
                 weights: str = "float32", cpu: bool = False, pool: bool = True,
                 use: str = "serve") -> tuple[int, int, int, int, int]:
    """(params, KV cache, activations, runtime layout beyond the params, loading overhead) bytes per device, for
    the caches `use` keeps (USES)."""
    params = cost.stage_param_bytes(cfg, n, first, last, tp, dtype, weights)
    if use == "generate":
        # every row's whole-sequence cache, the rows prefilled a micro-batch at a time; a pipeline stage also keeps
        # the one decode slot its StageSlots is made with (RayStages' rows=1, at most max_seq_len entries), idle
        rows = batch if first and last else batch + 1
        kv = n * cost.kv_cache_bytes(cfg, rows, max_seq_len, dtype, tp)
        prefill_batch = micro
    else:
        # the decode slots' cache, and the prefix cache's pool beside it (runner/prefix.py; counted even where it is
        # turned off, unless no plan has room for it: search)
        pool = prefix.default_blocks(batch, max_seq_len) * prefix.BLOCK_SIZE if pool else 0
        kv = n * (cost.kv_cache_bytes(cfg, batch, max_seq_len, dtype, tp)
                  + cost.kv_cache_bytes(cfg, 1, pool, dtype, tp))
    act = max(cost.activation_bytes(cfg, prefill_batch, max_seq_len, dtype, tp),
              cost.activation_bytes(cfg, micro, 1, dtype, tp))
    if last:
        act += cost.logits_bytes(cfg, max(micro, prefill_batch), tp)
    runtime = cost.runtime_extra_bytes(cfg, last, tp, dtype, weights, cpu, first)
    return params, kv, act, runtime, cost.load_bytes(cfg, n, first, last, tp, dtype, weights)


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A served draft model (runner/draft.py) a plan holds beside its first stage, in the serving process: its whole
    model on one device and a batch-1 cache for each drafting row, `extra` entries past the slots' max_seq_len
    (the widest chunk it is fed and the drafts)."""
    cfg: OPTConfig
    extra: int
    weights: str = "float32"          # "int8": the target's int8 weights, as the draft is loaded
    chunk: int = DRAFT_WIDTHS[-1]     # the widest chunk fed at once

    @classmethod
    def of(cls, cfg: OPTConfig, speculative: SpeculativeConfig, weights: str = "float32") -> "DraftModel":
        """The draft model a speculative_config names (`cfg`: its config), its rows' caches as runner/draft.py
        sizes them."""
        return cls(cfg, speculative.draft_cache_extra, weights)

    def peak_bytes(self, rows: int, max_seq_len: int, dtype: str, cpu: bool = False) -> int:
        """Its peak with `rows` drafting rows (greedy: the screened head makes no logits). It loads after the
        target's caches exist, so its loading overhead counts with them."""
        cfg, n = self.cfg, self.cfg.num_hidden_layers
        params = cost.stage_param_bytes(cfg, n, True, True, 1, dtype, self.weights)
        kv = n * cost.kv_cache_bytes(cfg, rows, max_seq_len + self.extra, dtype)
        act = cost.activation_bytes(cfg, 1, self.chunk, dtype)
        runtime = cost.runtime_extra_bytes(cfg, True, 1, dtype, self.weights, cpu, True)
        return peak_bytes(params, kv, act, runtime, cost.load_bytes(cfg, n, True, True, 1, dtype, self.weights))
