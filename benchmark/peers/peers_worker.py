"""The side processes of benchmark_peers.py, one a side and dtype, and the random-weights builder: each runs this
file alone, in its own interpreter, driven over a pipe (one JSON line a request, one a reply).

    python benchmark/peers/peers_worker.py {ours,ct2,hf} --model-dir FOLDER [--dtype float32|int8] [--threads N]
    python benchmark/peers/peers_worker.py build --model-dir OUT [--size opt-125m] [--seed 0] [--weight-scale 3]

They import nothing of the other side: the CTranslate2 one runs in the peer virtualenv, which has no opt_serving
and no jax. Nor does this file put the checkout on sys.path (the scripts beside it do): ours and the builder take
opt_serving from PYTHONPATH, which benchmark_peers.py sets to --ours-src.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path


def _worker_main(args) -> None:
    # replies go to the original stdout only; stray prints from the libraries go to stderr (the log)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**kw):
        proto.write(json.dumps(kw) + "\n")
        proto.flush()

    try:
        t0 = time.perf_counter()
        side = {"ours": OursSide, "ct2": Ct2Side, "hf": HfSide}[args.worker](args.model_dir, args.dtype, args.threads)
        load_s = time.perf_counter() - t0
    except (TypeError, NotImplementedError) as e:
        reply(ok=False, unavailable=True, error=f"{type(e).__name__}: {e}")
        return
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which stops)
        reply(ok=False, error=f"{type(e).__name__}: {e}")
        raise
    import gc
    gc.collect()
    gc.freeze()  # the loaded model's objects out of the collector's way, as `opt-serving batch` does
    reply(ok=True, load_s=load_s, info=side.info)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            return
        try:
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            out = side.generate(msg["ids"], msg["new"])
            dt = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)  # all of its threads
            reply(ok=True, seconds=dt, cpu_s=cpu, new_ids=out)
        except BaseException as e:  # noqa: BLE001
            reply(ok=False, error=f"{type(e).__name__}: {e}")
            raise


def quantize_supported(get_model, source: str) -> bool:
    """Whether get_model knows quantize=: a parameter of its own, or a key its own source (`source`) reads
    from its **kwargs (a name it never reads would be swallowed by **kwargs: float32 figures labelled int8)."""
    import inspect
    params = inspect.signature(get_model).parameters
    if "quantize" in params:
        return True
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return takes_kwargs and ('"quantize"' in source or "'quantize'" in source)


class OursSide:
    def __init__(self, folder: str, dtype: str, threads: int):
        import inspect

        from opt_serving.model import wrapper
        kwargs = {}
        if dtype == "int8":
            # get_model takes **kwargs, so an unknown quantize= would be silently ignored: ask for it only
            # where the code knows it, else say it is missing (the caller prints "not available")
            if not quantize_supported(wrapper.get_model, inspect.getsource(wrapper.get_model)):
                raise NotImplementedError("opt_serving's get_model has no quantize= option yet")
            kwargs["quantize"] = "int8"
        elif dtype != "float32":
            raise ValueError(f"ours: dtype {dtype}")
        self.model = wrapper.get_model("jax/opt-peers", path=folder, dtype="float32", **kwargs)
        self.cfg = self.model.config
        import jax
        self.info = {"jax": jax.__version__, "threads": threads, "quantize": kwargs.get("quantize"),
                     "opt_serving": str(Path(wrapper.__file__).parents[1])}

    def generate(self, ids, new: int):
        import numpy as np
        x = np.asarray(ids, np.int64)
        out = self.model.generate(input_ids=x, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=self.cfg.pad_token_id)
        out = np.asarray(getattr(out, "sequences", out))  # waits for JAX's asynchronous dispatch
        return out[:, x.shape[1]:].tolist()


class Ct2Side:
    def __init__(self, folder: str, dtype: str, threads: int):
        import ctranslate2
        self.gen = ctranslate2.Generator(folder, device="cpu", compute_type=dtype, inter_threads=1,
                                         intra_threads=threads)
        vocab = Path(folder) / "vocabulary.json"
        if vocab.exists():
            self.vocab = json.loads(vocab.read_text())
        else:
            self.vocab = (Path(folder) / "vocabulary.txt").read_text().split("\n")
        self.info = {"ctranslate2": ctranslate2.__version__, "compute_type": self.gen.compute_type,
                     "intra_threads": threads, "inter_threads": 1}

    def generate(self, ids, new: int):
        tokens = [[self.vocab[i] for i in row] for row in ids]
        res = self.gen.generate_batch(tokens, max_length=new, min_length=new, sampling_topk=1, beam_size=1,
                                      include_prompt_in_result=False)
        return [r.sequences_ids[0] for r in res]


class HfSide:
    def __init__(self, folder: str, dtype: str, threads: int):
        import torch
        import transformers
        if dtype != "float32":
            raise NotImplementedError("HF PyTorch: float32 only here")
        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.OPTForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.pad = self.model.config.pad_token_id
        self.info = {"torch": torch.__version__, "transformers": transformers.__version__,
                     "threads": torch.get_num_threads()}

    def generate(self, ids, new: int):
        torch = self.torch
        x = torch.tensor(ids, dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=self.pad)
        return out[:, x.shape[1]:].tolist()


def _build_main(args) -> None:
    """--worker build: a random OPT as a save_pretrained folder (float32 safetensors) + a word-level tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from opt_serving.config import get_config
    cfg = get_config(args.size)
    hf_cfg = transformers.OPTConfig(**{k: v for k, v in cfg.to_hf_dict().items()
                                       if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(args.seed)
    model = transformers.OPTForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(args.weight_scale)
    out = Path(args.model_dir)
    model.to(torch.float32).save_pretrained(out)
    # ids 0-3 as OPT's tokenizer has them; the rest named by id (CTranslate2 takes tokens as strings)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"tok{i}": i for i in range(len(specials), cfg.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one side of benchmark_peers.py (or its weights builder), over a pipe")
    p.add_argument("worker", choices=["ours", "ct2", "hf", "build"])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--size", default="opt-125m", help="build: the shape of the random model")
    p.add_argument("--seed", type=int, default=0, help="build: the weights' seed")
    p.add_argument("--weight-scale", type=float, default=3.0, help="build: every 2-D weight multiplied by this")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker == "build":
        _build_main(args)
    else:
        _worker_main(args)


if __name__ == "__main__":
    main()
