"""runner/generate.py: generate() as a host loop over the runner's stages, here two stages in this process (the
same StageSlots a Ray stage actor holds; tests/test_parallel_backend.py runs it over Ray stage actors). Greedy,
sampled and beam-searched tokens, and the processed scores, equal those of one whole-model stage's compiled loop."""
import numpy as np
import pytest

from conftest import SMALL

CFG = SMALL
IDS = np.array([[0, 0, 5, 9, 13], [3, 7, 11, 2, 8]], np.int32)  # the first left-padded
MASK = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int32)
CASES = [dict(max_new_tokens=6),
         dict(max_new_tokens=5, output_scores=True, return_dict_in_generate=True, repetition_penalty=1.3),
         dict(max_new_tokens=5, do_sample=True, temperature=0.8, top_k=20, seed=4, num_return_sequences=2),
         dict(max_new_tokens=5, num_beams=3, num_return_sequences=2)]


@pytest.fixture(scope="module")
def models():
    from opt_serving.model import param_tree, wrapper
    from opt_serving.parallel.stage_weights import stage_specs
    from opt_serving.runner.generate import Generation
    from opt_serving.runner.stage import LocalStages, StageSlots
    params = param_tree.init_params(CFG, seed=3, std=0.3)
    stages = LocalStages([StageSlots(CFG, param_tree.stage_params(params, s), s, 1, 1, 64)
                          for s in stage_specs(CFG, 2)])
    return Generation.of(wrapper.OPTModel(CFG, params)), Generation(CFG, stages, micro_batches=2)


@pytest.mark.parametrize("kw", CASES, ids=["greedy", "scores", "sampled", "beams"])
def test_two_local_stages_generate_the_one_device_models_tokens(models, kw):
    one, staged = models
    want, got = one.generate(IDS, MASK, **kw), staged.generate(IDS, MASK, **kw)
    if kw.get("return_dict_in_generate"):
        np.testing.assert_array_equal(got.sequences, want.sequences)
        assert len(got.scores) == len(want.scores) == 5
        for a, b in zip(got.scores, want.scores):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
    else:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the host loop closed every whole-sequence cache it opened in the stages
    assert all(not s.seqs for s in staged.stages.stages)
