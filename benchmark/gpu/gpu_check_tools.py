"""The GPU check's tools (gpu_check.py): where it runs, the same random weights on both sides (torch draws them,
JAX takes them through DLPack), XLA compiles counted, device memory, the engine driven to a rate, and the planner's
estimate to hold the memory against. gpu_engine_probe.py uses them too."""
from __future__ import annotations

import time

import numpy as np

PAD = 1


def device_name() -> str:
    import jax
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def sync_torch():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def torch_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- the same random weights on both sides ----

def hf_model(cfg, seed: int, dtype, device: str, peaked: float = 1.0):
    """HF's OPTForCausalLM for `cfg` on `device`, random from `seed` (HF's own init, std 0.02), SDPA attention,
    in `dtype`. `peaked` multiplies the matrices (tiny models: greedy choices far from ties) and moves the
    biases and norms off 0 / 1, as tests/conftest.py's hf_model does."""
    import torch
    import transformers
    torch.manual_seed(seed)
    hf_cfg = transformers.OPTConfig(**cfg.to_hf_dict(), attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.OPTForCausalLM(hf_cfg).to(dtype).eval()
    if peaked != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(peaked)
                else:
                    p.add_(0.1 * torch.randn_like(p))
    return model


def params_from_torch(cfg, model, dtype):
    """Our Flax param tree from a torch OPTForCausalLM's state dict, tensor by tensor, on JAX's default device
    (through DLPack: on a GPU the weights never visit the host)."""
    import jax
    import jax.numpy as jnp
    from opt_serving.model import weights
    tree: dict = {}
    for key, t in model.state_dict().items():
        name = weights.hf_key_to_metaseq(key)
        if name is None:  # the tied LM head
            continue
        path, transpose = weights.flax_path(name)
        t = t.detach().contiguous()
        try:
            a = jnp.from_dlpack(t)
        except Exception:  # noqa: BLE001 - a DLPack pairing this JAX and torch refuse: through the host
            a = jnp.asarray(t.float().cpu().numpy())
        a = jnp.array(a.T if transpose else a, dtype=dtype, copy=True)  # our own copy, torch's can go
        weights.set_path(tree, path, jax.device_put(a, jax.devices()[0]))
    return tree


def tree_bytes(tree) -> int:
    """Bytes of a tree of arrays (or of ShapeDtypeStructs)."""
    import jax
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)
               if hasattr(x, "dtype"))


class Compiles:
    """XLA compiles (and their seconds) since the last `take()`: a timed run that compiled measured a compile."""

    def __init__(self):
        import jax
        self.n, self.s = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, name, secs, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            self.n, self.s = self.n + 1, self.s + secs

    def take(self) -> tuple[int, float]:
        out, self.n, self.s = (self.n, round(self.s, 1)), 0, 0.0
        return out


def torch_allocated():
    import torch
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else None


def copy_bandwidth(nbytes: int, reps: int = 20) -> dict:
    """The card's device-to-device copy rate, the bound a decode step's bytes are read against: GB/s counting the
    bytes read and written, the median of `reps` copies of `nbytes`. On a CUDA card torch's copy_, timed by CUDA
    events (a jitted x + 1 in JAX moved a third less on an H200: 2.7-2.8 TB/s against torch's 4.25); else x + 1
    in JAX, timed on the host."""
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if cuda:
        src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
        dst, times = torch.empty_like(src), []
        for _ in range(3):
            dst.copy_(src)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
        probe = "torch copy_"
    else:
        import jax
        import jax.numpy as jnp
        x = jnp.ones((nbytes // 2,), jnp.float16)
        bump = jax.jit(lambda v: v + 1)
        jax.block_until_ready(bump(x))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(bump(x))
            times.append(time.perf_counter() - t0)
        probe = "jax x + 1"
    s = float(np.median(times))
    return {"probe": probe, "copy_bytes": nbytes, "copy_ms": round(s * 1e3, 3),
            "gb_per_s": round(2 * nbytes / s / 1e9, 1)}


class StepBytes:
    """What one decode step must read: every weight once and the KV entries written so far of each row, and the
    time that takes at the measured copy bandwidth (the step's floor; the sampler and the writes are left out)."""

    def __init__(self, cfg, param_bytes: int, dtype: str, gb_per_s: float):
        self.param_bytes, self.gb_per_s = param_bytes, gb_per_s
        self.kv_per_token = cfg.num_hidden_layers * 2 * cfg.hidden_size * np.dtype(dtype).itemsize  # K and V

    def bytes(self, batch: int, context: int) -> int:
        return self.param_bytes + batch * context * self.kv_per_token

    def bound_ms(self, batch: int, context: int) -> float:
        return self.bytes(batch, context) / (self.gb_per_s * 1e9) * 1e3

    def row(self, batch: int, context: int) -> dict:
        """`context`: the mean number of cached positions a row attends over during the run."""
        return {"step_bytes": self.bytes(batch, context), "bound_ms": round(self.bound_ms(batch, context), 4),
                "bound_context": context}


def jax_memory() -> dict:
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def engine_tokens(engine, prompts, n: int) -> list[list[int]]:
    """Greedy tokens of each prompt through the engine, all submitted at once, no stop token."""
    import threading
    from opt_serving.engine.scheduler import SlotSettings
    out = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def callback(i):
        def on_output(o):
            if o.error is not None:
                raise o.error
            out[i].extend(t.id for t in o.tokens if not o.is_prompt)
            if o.finish_reason is not None:
                done.release()
        return on_output
    # queued under the engine's lock (re-entrant: submit takes it too), so its next iteration sees the whole
    # batch and every run admits it the same way, in shapes the first run compiled
    with engine._cv:
        for i, p in enumerate(prompts):
            engine.submit(p, SlotSettings(max_tokens=n, logprob=False, top_logprobs=False), callback(i))
    for _ in prompts:
        done.acquire()
    return out


def engine_rate(engine, batch: int, prompt_len: int, n: int, vocab: int, rng) -> float:
    """`batch` requests of `prompt_len` random ids submitted at once, each making `n` greedy tokens -> new
    tokens/s from the first submit to the last token."""
    prompts = [rng.integers(4, vocab, prompt_len).tolist() for _ in range(batch)]
    t0 = time.perf_counter()
    out = engine_tokens(engine, prompts, n)
    dt = time.perf_counter() - t0
    assert all(len(o) == n for o in out), [len(o) for o in out]
    return batch * n / dt


def engine_ttft(engine, batch: int, prompt_len: int, n: int, vocab: int, rng) -> dict:
    """`batch` prompts of `prompt_len` random ids submitted at once, `n` greedy tokens each: the seconds from
    the submit to each one's first token (p50, p99, max) and the new tokens/s of the whole wave."""
    import threading
    from opt_serving.engine.scheduler import SlotSettings
    first, done = [None] * batch, threading.Semaphore(0)

    def callback(i):
        def on_output(o):
            if o.error is not None:
                raise o.error
            if first[i] is None and o.tokens and not o.is_prompt:
                first[i] = time.perf_counter()
            if o.finish_reason is not None:
                done.release()
        return on_output
    prompts = [rng.integers(4, vocab, prompt_len).tolist() for _ in range(batch)]
    with engine._cv:  # the whole wave in the engine's queue before its next iteration (as engine_tokens)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.submit(p, SlotSettings(max_tokens=n, logprob=False, top_logprobs=False), callback(i))
    for _ in prompts:
        done.acquire()
    total = time.perf_counter() - t0
    ttft = np.array([f - t0 for f in first])
    return {"p50_s": round(float(np.percentile(ttft, 50)), 4), "p99_s": round(float(np.percentile(ttft, 99)), 4),
            "max_s": round(float(ttft.max()), 4), "tokens_per_s": round(batch * n / total, 1)}


def engine_counts(before, after, prefix: str = "") -> dict:
    """What the engine did between two of its stats(): decode steps, the calls that took them, prefills, and of
    those the prompts that joined a step."""
    return {prefix + k: getattr(after, k) - getattr(before, k) for k in ("steps", "step_calls", "prefills", "joined")}


def planner_estimate(cfg, size: str, dtype: str, batch: int, max_seq_len: int, weights: str = "float32") -> dict:
    """What the planner counts for one device holding the whole model (pp = tp = 1) at this batch and context."""
    from opt_serving.parallel import cluster, planner
    plan = planner.best_plan(cfg, cluster.cluster_from_jax(), model=f"jax/opt-{size}", batch_size=batch,
                             max_seq_len=max_seq_len, dtype=dtype, tensor_parallel=1, pipeline_parallel=1,
                             data_parallel=1, weights=weights)
    st = plan.stages[0]
    return {"plan_param_bytes": st.param_bytes, "plan_kv_bytes": st.kv_bytes, "plan_act_bytes": st.act_bytes,
            "plan_memory_bytes": st.memory_bytes, "plan_limit_bytes": plan.memory_limit}
