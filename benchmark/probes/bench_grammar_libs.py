"""Per-step cost of three structured-output libraries on this CPU, with the real OPT tokenizer.

    .venv/bin/python benchmark/probes/bench_grammar_libs.py [--tokenizer ../shared/opt-assets] [--streams 32] [--steps 400]

For xgrammar, llguidance and outlines-core (each where it is installed; the project itself needs only the one it
chose, see benchmark/README.md), `--streams` streams each follow a JSON schema with bounded whitespace: every
step computes each stream's token mask (a bitmask of the 50272-entry vocabulary, as a decode step needs it) and
advances its matcher by one allowed token, drawn at random from the mask (the model's part, not timed). A
stream whose object is complete starts a new one. Prints, per library, the compile time of the schema (and of
the tokenizer's tables, once), and the time of one step's masks and advances for all streams, per stream too.
Rounds alternate the libraries, so a busy machine slows them alike.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from opt_serving.text.tokenizer import load_tokenizer

VOCAB = 50272  # OPT's embedding rows (the tokenizer has 50265 entries)
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}


def allowed(bitmask_row: np.ndarray) -> np.ndarray:
    """Token ids set in one row of an int32 bitmask."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:VOCAB])


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.hf
        import llguidance.numpy
        self.lib, self.np = llguidance, llguidance.numpy
        t = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
        self.setup_s = time.perf_counter() - t

    def compile(self):
        g = self.lib.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
        err = self.lib.LLMatcher.validate_grammar(g, self.tok)
        assert not err, err
        return g

    def matcher(self, grammar):
        return self.lib.LLMatcher(self.tok, grammar)

    def fill(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            self.np.fill_next_token_bitmask(m, bitmask, i)

    def advance(self, m, token) -> bool:
        assert m.consume_token(int(token)), m.get_error()
        return m.is_stopped()

    @staticmethod
    def reset(m):
        m.reset()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import torch
        import xgrammar
        self.lib, self.torch = xgrammar, torch
        t = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup_s = time.perf_counter() - t

    def compile(self):
        return self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)

    def matcher(self, grammar):
        return self.lib.GrammarMatcher(grammar)

    def fill(self, matchers, bitmask):
        t = self.torch.from_numpy(bitmask)  # shares the buffer
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(t, i)

    def advance(self, m, token) -> bool:
        assert m.accept_token(int(token))
        return m.is_terminated()

    @staticmethod
    def reset(m):
        m.reset()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
        from opt_serving.text.token_text import TokenTexts
        self.lib, self.build = outlines_core, build_regex_from_schema
        t = time.perf_counter()
        texts, vocab = TokenTexts(tokenizer), {}
        for i in range(len(tokenizer)):
            data = texts.token_bytes(i)
            if data is not None:
                vocab.setdefault(data, []).append(i)
        self.vocab = outlines_core.Vocabulary(EOS, vocab)
        self.setup_s = time.perf_counter() - t

    def compile(self):
        return self.lib.Index(self.build(json.dumps(SCHEMA), r"[ ]?"), self.vocab)  # at most one space

    def matcher(self, index):
        return self.lib.Guide(index)

    def fill(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            row = bitmask[i]
            m.write_mask_into(row.ctypes.data, row.size, row.itemsize)

    def advance(self, m, token) -> bool:
        m.advance(int(token))
        return m.is_finished()

    @staticmethod
    def reset(m):
        m.reset()


def run(lib, grammar, streams: int, steps: int, rng) -> tuple[float, float, int]:
    """(seconds per step for masks, for advances, objects finished) over `steps` steps of `streams` streams."""
    matchers = [lib.matcher(grammar) for _ in range(streams)]
    bitmask = np.zeros((streams, (VOCAB + 31) // 32), np.int32)
    mask_s = advance_s = 0.0
    done = 0
    for _ in range(steps):
        t = time.perf_counter()
        lib.fill(matchers, bitmask)
        mask_s += time.perf_counter() - t
        picks = []
        for i in range(streams):  # the model's choice: any allowed token, EOS only when nothing else is
            ok = allowed(bitmask[i])
            rest = ok[ok != EOS]
            picks.append(rng.choice(rest) if len(rest) else EOS)
        t = time.perf_counter()
        finished = [lib.advance(m, tok) for m, tok in zip(matchers, picks)]
        advance_s += time.perf_counter() - t
        for m, f, tok in zip(matchers, finished, picks):
            if f or tok == EOS:
                lib.reset(m)
                done += 1
    return mask_s / steps, advance_s / steps, done


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default="../shared/opt-assets")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    libs = []
    for cls in (Xgrammar, Llguidance, OutlinesCore):
        try:
            libs.append(cls(tokenizer))
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
    grammars = {}
    for lib in libs:
        t = time.perf_counter()
        grammars[lib.name] = lib.compile()
        compile_s = time.perf_counter() - t
        t = time.perf_counter()  # a request's own matcher (llguidance builds its parser here)
        lib.fill([lib.matcher(grammars[lib.name])], np.zeros((1, (VOCAB + 31) // 32), np.int32))
        first_s = time.perf_counter() - t
        print(f"{lib.name}: tokenizer tables {lib.setup_s * 1e3:.0f} ms, schema compile {compile_s * 1e3:.1f} ms, "
              f"a request's matcher and its first mask {first_s * 1e3:.1f} ms")
    results: dict = {lib.name: [] for lib in libs}
    for r in range(args.rounds):
        for lib in libs:
            mask, adv, done = run(lib, grammars[lib.name], args.streams, args.steps, np.random.default_rng(r))
            results[lib.name].append((mask, adv))
            print(f"round {r} {lib.name:>13}: {args.streams} streams, mask {mask * 1e3:.3f} ms + advance "
                  f"{adv * 1e3:.3f} ms a step ({(mask + adv) / args.streams * 1e6:.1f} us a stream), "
                  f"{done} objects finished", flush=True)
    for lib in libs:
        total = [m + a for m, a in results[lib.name]]
        print(f"{lib.name:>13}: median {statistics.median(total) * 1e3:.3f} ms a step for {args.streams} streams "
              f"({statistics.median(total) / args.streams * 1e6:.1f} us a stream)")


if __name__ == "__main__":
    main()
