"""Pipeline stages, chained in this process, reproduce the whole model."""
import numpy as np
import pytest

from conftest import SMALL

CFG = SMALL
IDS = np.array([[1, 1, 5, 9, 17, 3], [4, 8, 15, 16, 23, 42]], np.int32)   # row 0 left-padded
MASK = np.array([[0, 0, 1, 1, 1, 1], [1] * 6], np.int32)


def _run(prefill, decode, steps=5):
    logits = [np.asarray(prefill(IDS, MASK))]
    tokens = []
    pos, tok = MASK.sum(1) - 1, logits[0][:, -1].argmax(-1).astype(np.int32)
    for i in range(steps):
        tokens.append(tok)
        pos = (pos + 1).astype(np.int32)
        lg = np.asarray(decode(tok, pos, np.full(2, IDS.shape[1] + i, np.int32)))
        logits.append(lg)
        tok = lg.argmax(-1).astype(np.int32)
    return logits, np.stack(tokens, 1)


@pytest.fixture(scope="module")
def reference():
    from opt_serving.model import opt, param_tree
    from opt_serving.model.kv_cache import init_cache
    params = param_tree.init_params(CFG, seed=5, std=0.2)
    state = {"cache": init_cache(CFG, 2, 32)}

    def prefill(ids, mask):
        out, state["cache"] = opt.prefill(CFG, params, state["cache"], ids, mask)
        return out

    def decode(*args):
        out, state["cache"] = opt.decode(CFG, params, state["cache"], *args)
        return out
    return params, _run(prefill, decode)


def _check(got, ref):
    for a, b in zip(ref[0], got[0]):
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(got[1], ref[1])


@pytest.mark.parametrize("split", [[2, 2], [1, 3], [1, 1, 1, 1]])
def test_local_stages_equal_the_model(reference, split):
    """The model's own modules over each stage's layers (opt.StageSpec), as the stage actors run them."""
    from opt_serving.model import param_tree
    from opt_serving.parallel.pipeline import stage_specs
    from opt_serving.runner.stage import StageSlots
    params, ref = reference
    specs = stage_specs(CFG, len(split), split)
    assert [(s.start, s.stop, s.first, s.last) for s in specs][-1] == (4 - split[-1], 4, len(split) == 1, True)
    stages = [StageSlots(CFG, param_tree.stage_params(params, s), s, rows=1) for s in specs]
    for s in stages:
        s.seq_open(0, 2, 32)

    def prefill(ids, mask):
        x = ids
        for s in stages:
            x = s.seq_prefill(0, x, mask, True)
        return x

    def decode(tok, pos, idx):
        x = tok
        for s in stages:
            x = s.seq_decode(0, x, pos, idx)
        return x
    _check(_run(prefill, decode), ref)


def test_split_layers_checks_cover():
    from opt_serving.parallel.pipeline import split_layers
    assert [len(r) for r in split_layers(10, 3)] == [4, 3, 3]
    with pytest.raises(ValueError, match="does not cover 4 layers"):
        split_layers(4, 2, [1, 2])

# The Ray stage actors are tested through the alpa/ backend in test_parallel_backend.py.


def test_a_node_without_the_weights_names_itself_and_the_path(tmp_path):
    from opt_serving.parallel.pipeline import load_stage_params, stage_specs
    missing = tmp_path / "opt-tiny-np"
    with pytest.raises(FileNotFoundError, match=r"node \S+ .*has no numpy weights folder at .*opt-tiny-np"):
        load_stage_params(missing, CFG, stage_specs(CFG, 2)[1])
