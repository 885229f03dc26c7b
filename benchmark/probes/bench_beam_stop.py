"""What a stoppable beam search costs: generate(num_beams=4, max_new_tokens=64) on one 32-token prompt with
`should_stop` (asked through a host callback before every step, as the server's searches are) and without,
alternating in one process.

    .venv/bin/python benchmark/probes/bench_beam_stop.py tiny|125m [PAIRS, default 8]
"""
import time, numpy as np, sys
from opt_serving.model.wrapper import get_model
from opt_serving.model.embedded import ensure_embedded_model
name = sys.argv[1]
m = get_model("jax/opt-tiny", str(ensure_embedded_model())) if name == "tiny" else get_model("jax/opt-125m", dummy=True)
ids = np.random.default_rng(0).integers(4, 1000, (1, 32)).astype(np.int32)
kw = dict(num_beams=4, max_new_tokens=64, min_new_tokens=64)
for f in (None, lambda: False):
    m.generate(ids, should_stop=f, **kw)  # compile
res = {"plain": [], "should_stop": []}
for i in range(int(sys.argv[2]) if len(sys.argv) > 2 else 8):
    for key, f in (("plain", None), ("should_stop", lambda: False)):
        t = time.perf_counter(); np.asarray(m.generate(ids, should_stop=f, **kw)); res[key].append(time.perf_counter() - t)
for k, v in res.items():
    print(name, k, "median %.1f ms, min %.1f, max %.1f (%d runs, alternating)" % (1e3*np.median(v), 1e3*min(v), 1e3*max(v), len(v)))
