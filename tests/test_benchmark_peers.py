"""benchmark/peers/benchmark_peers.py without CTranslate2: arguments, prompts, agreement, tables, int8 detection."""
from types import SimpleNamespace

import pytest

from benchmark.peers import benchmark_peers, peers_build, peers_report, peers_sides, peers_worker


@pytest.fixture(scope="module")
def bp():
    """The script's names, from the modules it is split into (the script itself last: its own names win)."""
    names = {}
    for mod in (peers_worker, peers_build, peers_sides, peers_report, benchmark_peers):
        names.update((k, v) for k, v in vars(mod).items() if not k.startswith("__"))
    return SimpleNamespace(**names)


def test_defaults(bp):
    a = bp.parse_args([])
    assert a.batch_sizes == [1, 16, 64] and a.prompt_len == 16 and a.gen_len == 64
    assert a.dtypes == ["float32", "int8"] and a.prefill is None and a.reps == 3
    assert a.peer_python.endswith(".venv-peers/bin/python")


def test_arguments(bp):
    a = bp.parse_args(["--prefill", "512,1024", "--dtypes", "float32", "--batch-sizes", "2,8",
                       "--ct2-env", "CT2_USE_MKL=1"])
    assert a.prefill == [512, 1024] and a.dtypes == ["float32"] and a.batch_sizes == [2, 8]
    assert bp.parse_args(["--dtypes", "int8,float32"]).dtypes == ["float32", "int8"]  # int8's reference first
    assert a.ct2_env == ["CT2_USE_MKL=1"]
    for bad in (["--dtypes", "float16"], ["--batch-sizes", "0"], ["--prefill", "x"], ["--reps", "0"],
                ["--ct2-env", "NOEQUALS"]):
        with pytest.raises(SystemExit):
            bp.parse_args(bad)


def test_prompts_and_agreement(bp):
    p = bp.make_prompts(4, 16, 50272, seed=0)
    assert p == bp.make_prompts(4, 16, 50272, seed=0)
    assert len(p) == 4 and all(len(r) == 16 for r in p)
    assert all(4 <= t < 50265 for r in p for t in r)
    assert p != bp.make_prompts(4, 16, 50272, seed=1)
    assert bp.agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == 0.75


def test_generation_table(bp):
    rows = [{"dtype": "float32", "batch": 16, "agree": 1.0,
             "ours": {"runs": [600.0, 640.0, 620.0], "median": 620.0},
             "ct2": {"runs": [300.0, 320.0, 310.0], "median": 310.0}},
            {"dtype": "int8", "batch": 16, "ct2": {"runs": [500.0], "median": 500.0},
             "vs_float32": {"ct2": 0.5}}]
    text = bp.generation_table(rows)
    lines = text.splitlines()
    assert lines[0].startswith("| dtype | batch | ours tokens/s")
    assert "| float32 | 16 | 600.0, 640.0, 620.0 | 300.0, 320.0, 310.0 | 620.0 | 310.0 | **2.00x** |" in lines[2]
    assert "25.8 | 51.6 | 100% | - |" in lines[2]  # ms/token = 1000 x batch / tokens/s
    assert "| int8 | 16 | not available | 500.0 | - | 500.0 | - | - | 32.0 | - | - / 50% |" in lines[3]


def test_prefill_table(bp):
    rows = [{"dtype": "float32", "prompt": 512, "ours": {"runs": [1000.0], "median": 1000.0},
             "ct2": {"runs": [800.0], "median": 800.0}, "hf": {"runs": [250.0], "median": 250.0}}]
    line = bp.prefill_table(rows).splitlines()[2]
    assert "| float32 | 512 | 1000 | 800 | 250 | 1000 | 800 | 250 | **1.25x** | **4.00x** | 512.0 |" == line


def test_quantize_detection(bp):
    def plain(name, path=None, dtype="float32"):
        pass

    def with_kwargs(name, path=None, **kwargs):
        pass

    def named(name, path=None, quantize=None, **kwargs):
        pass

    assert not bp.quantize_supported(plain, "kwargs.get('quantize')")  # no way to pass it
    # swallowed by **kwargs: a mention in prose is not reading it
    assert not bp.quantize_supported(with_kwargs, "def with_kwargs(name, **kwargs):  # no quantize here")
    assert bp.quantize_supported(with_kwargs, "q = kwargs.get('quantize')")
    assert bp.quantize_supported(with_kwargs, 'q = kwargs.pop("quantize", None)')
    assert bp.quantize_supported(named, "")


def test_ct2_backend_from_log(bp):
    log = """[info] CPU: AuthenticAMD (SSE4.1=true, AVX=true, AVX2=true, AVX512=true)
[info]  - Selected ISA: AVX2
[info]  - Use Intel MKL: false
[info]  - SGEMM backend: DNNL (packed: false)
[info]  - GEMM_S16 backend: none (packed: false)
[info]  - GEMM_S8 backend: DNNL (packed: false, u8s8 preferred: true)"""
    assert bp.ct2_backend_from_log(log) == "ISA AVX2, MKL false, SGEMM DNNL, GEMM_S8 DNNL"
    assert bp.ct2_backend_from_log("") == ""


def test_missing_peer_python_says_how_to_make_it(bp, tmp_path):
    with pytest.raises(SystemExit, match="venv .venv-peers"):
        bp.check_peer_python(str(tmp_path / "nope" / "python"))


def test_prefill_table_int8_without_ours(bp):
    rows = [{"dtype": "int8", "prompt": 512, "ct2": {"runs": [3000.0], "median": 3000.0}}]
    line = bp.prefill_table(rows).splitlines()[2]
    assert line == "| int8 | 512 | not available | 3000 | - | - | 3000 | - | - | - | - |"


def test_disturbed_runs_are_starred(bp):
    side = {"runs": [600.0, 75.0, 640.0], "disturbed": [False, True, False], "median": 620.0}
    assert bp._runs(side, 1) == "600.0, 75.0*, 640.0"
    assert bp._runs({"runs": [1.0]}, 0) == "1"  # rows written before the flag existed


class FakeSide:
    def __init__(self, name, log, seconds, others):
        self.name, self.log, self.seconds, self.others = name, log, list(seconds), list(others)
        self.last_cores = None

    def call(self, ids, new):
        self.log.append(self.name)
        self.last_cores = (2.0, self.others.pop(0) if self.others else 0.0)
        return (self.seconds.pop(0) if self.seconds else 1.0), [[7] * new for _ in ids]


def test_measure_interleaves_and_leaves_disturbed_calls_out(bp):
    args = bp.parse_args(["--reps", "3", "--warmup", "1", "--pause", "0"])
    log = []
    # one warm-up call each (its figures unused), then three timed calls each
    a = FakeSide("A", log, [9.0, 1.0, 1.0, 2.0], [0.0, 0.0, 1.5, 0.0])
    b = FakeSide("B", log, [9.0, 2.0, 4.0, 2.0], [0.0, 0.0, 0.0, 0.0])
    res = bp.measure({"ours": a, "ct2": b}, [[5, 6]], 4, args, "test", unit_tokens=4)
    assert log == ["A", "B", "A", "B", "A", "B", "A", "B"]
    assert res["ours"]["runs"] == [4.0, 4.0, 2.0] and res["ours"]["disturbed"] == [False, True, False]
    assert res["ours"]["median"] == 3.0  # of the two undisturbed calls
    assert res["ct2"]["runs"] == [2.0, 1.0, 2.0] and res["ct2"]["median"] == 2.0


def test_batch_one_is_held_against_the_bandwidth_read_between_its_runs(bp, monkeypatch):
    monkeypatch.setattr(peers_sides, "read_bandwidth_gbs",
                        lambda *a, **k: pytest.fail("a reading taken after the runs"))
    cfg = {"hidden_size": 4, "ffn_dim": 8, "num_hidden_layers": 2, "vocab_size": 10}
    per_token = bp.weight_bytes_per_token(cfg, "int8")
    assert per_token == 2 * (4 * 4 * 4 + 2 * 4 * 8) + 10 * 4  # every layer's four matrices and the head, a byte each
    readings = [30.0, 40.0, 35.0]  # GB/s, one before each round: the median, 35, sets the bound
    limit = 35e9 / per_token
    row = {"dtype": "int8", "batch": 1, "ours": {"median": 0.8 * limit, "bandwidth": readings},
           "ct2": {"median": 0.25 * limit, "bandwidth": readings}}
    lines = bp.bandwidth_lines([row, {"dtype": "int8", "batch": 16}], cfg, threads=2)
    assert "read bandwidth 35.0 GB/s (readings 30.0, 40.0, 35.0)" in lines[1], lines
    assert f"at most {limit:.1f} tokens/s" in lines[2] and "(80%)" in lines[2] and "(25%)" in lines[2], lines
    assert len(lines) == 3  # batch 16 has no bound here
