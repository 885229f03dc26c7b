"""Text in, completions out: the backend the HTTP service and the batch runner call.

`Generator` is a `Checker` (checking.py: it checks and tokenises prompts, the checks being request.py's) that
turns `SamplingParams` into per-request engine settings and hands the engine's tokens to each request's text state
(completion.py), which sends them back as `Delta`s: incremental detokenisation, stop strings, echo, logprobs and
offsets.

    gen = Generator(engine, tokenizer)                  # or loading.load_generator(model, path, ...)
    async for delta in gen.stream("Hello", SamplingParams(max_tokens=8, stop=["\\n"])):   # in an event loop
        print(delta.text, end="")
    completion = await gen.complete("Hello", params)
    [[c0, c1]] = gen.complete_many(["Hello"], params, n=2, best_of=4)                    # blocking
    c = await gen.beam("Hello", params, num_beams=4)                # HF beam search, off the event loop

Conventions (OpenAI's legacy completions API):
  * `text_offset` counts characters into prompt text + completion text, also without echo.
  * `token_logprobs` are the model's log-softmax before temperature/penalties; `top_logprobs[i]` holds the
    `logprobs` most likely tokens plus the chosen one.
  * echo lists every token the model read, as OpenAI and vLLM do: for a text prompt the BOS the tokenizer adds
    (OPT's leading </s>) comes first, with a None logprob, but its text is not part of the echoed text (which
    is the prompt as sent); a prompt sent as token ids is echoed id for id. `prompt_tokens` (usage) counts the
    same tokens.
  * EOS is not part of `text`/`tokens`; tokens cut by a stop string are dropped, but `completion_tokens` (usage)
    counts every token the model generated, EOS and cut ones included; `cumulative_logprob` sums them all
    (best_of ranks by it).
  * The generated tokens are scored (`token_logprobs`, `cumulative_logprob`; None otherwise) only where the
    request needs it: `logprobs` is set, best_of > n ranks the samples, or `score_tokens=True`. So an engine
    step where every request is plainly greedy and unscored may skip the logits (the CPU's screened greedy
    head), without the caller saying so.
  * `logit_bias` is added to the logits the token is chosen from, and structured output masks them; neither
    changes the reported logprobs, which stay the model's own (vLLM's default, raw logprobs).
The engine's output callback runs on the engine thread; so does each request's text state, so a stop string
frees the slot before the next step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from opt_serving.engine.scheduler import Engine, EngineRequest, QueueFull, SlotSettings
from opt_serving.errors import InvalidRequest
from opt_serving.text.beam import BeamQueue, BeamSearch, BeamStream, beam_cost, run_beam, run_best_beam
from opt_serving.text.checking import Checker
from opt_serving.text.completion import Collector, Completion, Delta, DeltaStream, RequestText, best
from opt_serving.text.request import Prompt, SamplingParams, check_n, stop_ids
from opt_serving.text.structured import grammar_of

# what callers import from here
__all__ = ["Completion", "Delta", "DeltaStream", "Generator", "Prompt", "SamplingParams"]


class Generator(Checker):
    """Prompts -> completions over an engine (`engine.Engine` or the fake one)."""

    def __init__(self, engine: Engine, tokenizer, max_seq_len: Optional[int] = None,
                 model_name: str = "opt", model=None, beam_budget: Optional[int] = None):
        """`model`: what `beam()` calls `generate(num_beams=...)` on; by default a `runner.generate.Generation`
        over the engine's own stages (no second copy of the weights), when the engine's slot model has them.
        `beam_budget`: beam tokens (num_beams x (prompt + max_tokens)) that searches running and waiting may
        hold together (beam.py); default: what the engine's decode slots hold, num_slots x max_seq_len."""
        super().__init__(engine, tokenizer, max_seq_len, model_name)
        self._rng = random.Random()
        self._model = model
        self._beams = BeamQueue(engine.max_queue, beam_budget or engine.num_slots * engine.max_seq_len)
        self._closed = False

    # ---- streaming (call inside an event loop) ----
    def stream(self, prompt: Prompt, params: SamplingParams, ids: Optional[list[int]] = None) -> DeltaStream:
        """Start a request now and return its deltas. Raises at once what `prepare()` raises, QueueFull and
        EngineClosed. `ids`: the prompt as `prepare()` checked and tokenised it with these params."""
        if ids is None:
            ids = self.prepare(prompt, params)
        out = DeltaStream(self.engine)
        out._req = self._start(prompt, params, out._sink, ids)
        return out

    async def complete(self, prompt: Prompt, params: SamplingParams) -> Completion:
        stream = self.stream(prompt, params)
        try:
            return Completion.join([d async for d in stream])
        finally:
            stream.cancel()

    async def complete_n(self, prompt: Prompt, params: SamplingParams, n: int = 1,
                         best_of: Optional[int] = None, ids: Optional[list[int]] = None) -> list[Completion]:
        """`best_of` (default n) samples with distinct seeds, the n with the highest cumulative logprob.
        `ids`: the prompt as `prepare()` checked and tokenised it with `params`."""
        best_of = check_n(n, best_of)
        if ids is None:
            ids = self.prepare(prompt, params)
        streams: list[DeltaStream] = []
        try:  # a later stream() that raises (QueueFull) must cancel the ones already queued
            for p in self.choice_params(params, best_of, n):  # (seeds and scoring: the same checks hold)
                streams.append(self.stream(prompt, p, ids))
            done = await asyncio.gather(*(self._join(s) for s in streams))
        finally:
            for s in streams:
                s.cancel()
        return best(done, n) if best_of > n else done

    @staticmethod
    async def _join(stream: DeltaStream) -> Completion:
        return Completion.join([d async for d in stream])

    # ---- beam search (beam.py: the model's own generate(), one request at a time on a worker thread) ----
    def beam(self, prompt: Prompt, params: SamplingParams, num_beams: int,
             early_stopping: bool = False) -> "asyncio.Future[Completion]":
        """Start a beam search now (call inside an event loop); await the result. Uses max_tokens,
        min_tokens, repetition_penalty, no_repeat_ngram_size, bad_words_ids, stop and ignore_eos of `params`
        (sampling fields are ignored: beam search is deterministic). Raises at once like `stream()`
        (InvalidRequest also when there is no model to search with, or the search is over the whole beam
        budget), QueueFull (the budget or the queue has no room now), EngineClosed. Cancelling the future
        drops a search that has not started and stops a running one before its next step."""
        return self.beams([(prompt, params)], num_beams, early_stopping)[0]

    def beams(self, jobs: Sequence[tuple[Prompt, SamplingParams]], num_beams: int,
              early_stopping: bool = False) -> list["asyncio.Future[Completion]"]:
        """`beam()` for several prompts of one request, queued all together or refused all together (their
        beam tokens summed against the budget)."""
        return self._searches(jobs, BeamSearch(num_beams, early_stopping=early_stopping), run_best_beam)

    def beam_streams(self, jobs: Sequence[tuple[Prompt, SamplingParams]], search: BeamSearch) -> list[BeamStream]:
        """Beam searches for several prompts of one request (vLLM's use_beam_search: `search.num_return` choices
        a prompt), queued or refused together as `beams()`: each prompt's returned beams, best first, as streams
        of one delta each (text/beam.py's BeamStream), prompt after prompt. Cancelling one stops its search."""
        return [BeamStream(f, r) for f in self._searches(jobs, search, run_beam) for r in range(search.num_return)]

    def _searches(self, jobs: Sequence[tuple[Prompt, SamplingParams]], search: BeamSearch, run) -> list:
        """Queue `run(model, ids, params, search, ...)` for every job, or refuse them all: the futures of their
        results."""
        num_beams, num_return = search.num_beams, search.num_return
        if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
            raise InvalidRequest(f"num_beams must be an integer >= 1, got {num_beams!r}", param="num_beams")
        if not 1 <= num_return <= num_beams:
            raise InvalidRequest(f"beams returned ({num_return}) must be from 1 to num_beams ({num_beams})",
                                 param="n")
        for _, params in jobs:
            for name in ("structured", "logit_bias", "prompt_logprobs", "lora"):  # the slots' features, not generate()'s
                if getattr(params, name) not in (None, {}):
                    what = {"structured": "structured output", "lora": "a LoRA adapter"}.get(name, name)
                    raise InvalidRequest(f"{what} is not available with beam search", param="num_beams")
            for name, asked in (("logprobs", params.logprobs is not None), ("echo", params.echo)):
                if asked:  # (generate()'s beams carry no scores, nor the prompt)
                    raise InvalidRequest(f"{name} is not available with beam search", param=name)
        model = self.beam_model()
        searches = []
        for prompt, params in jobs:
            ids = self.prepare(prompt, params)
            if params.max_tokens < 1:
                raise InvalidRequest("max_tokens must be >= 1 for beam search", param="max_tokens")
            searches.append((beam_cost(num_beams, len(ids), params.max_tokens), run,
                             (model, ids, params, search, self.eos_token_id, self.decode, self.token_text)))
        futures = []
        for job in self._beams.submit_all(searches):
            future = asyncio.wrap_future(job.future)
            # a cancelled await (client gone, timeout) stops the search itself, not only its result
            future.add_done_callback(lambda f, job=job: job.cancel() if f.cancelled() else None)
            futures.append(future)
        return futures

    def beam_model(self):
        """The model beam search runs on; InvalidRequest if this generator has none."""
        if self._model is None:
            if not self.engine.model.runs_generate:
                raise InvalidRequest(f"beam search (num_beams > 1) is not available for {self.model_name}: its "
                                     "engine has no model to run generate() on", param="num_beams")
            self._model = self.engine.model.generation_model()
        return self._model

    # ---- blocking (batch tool, notebooks; not on the event loop thread) ----
    def iter_complete(self, prompts: Sequence[Prompt], params: Union[SamplingParams, Sequence[SamplingParams]],
                      n: int = 1, best_of: Optional[int] = None) -> Iterator[tuple[int, list[Completion]]]:
        """Yield `(prompt_index, n completions)` as prompts finish (not in order). Everything is checked
        before anything runs; a full queue makes it wait rather than fail."""
        best_of = check_n(n, best_of)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        prepared = [self.prepare(pr, p) for pr, p in zip(prompts, plist)]
        wake = threading.Condition()
        finished: list[int] = []
        collectors: dict[int, list[Collector]] = {}

        def on_done(i: int) -> Callable[[], None]:
            def f() -> None:
                with wake:
                    if all(c.done.is_set() for c in collectors[i]):
                        finished.append(i)
                    wake.notify()
            return f

        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist)):
                # all of a prompt's collectors exist before any can finish
                collectors[i] = [Collector(on_done(i)) for _ in range(best_of)]
                for cp, col in zip(self.choice_params(p, best_of, n), collectors[i]):
                    while True:
                        try:
                            self._start(prompt, cp, col, prepared[i])
                            break
                        except QueueFull:
                            with wake:
                                wake.wait(0.05)  # poll: the queue drains without telling us
                        yield from self._drain(finished, collectors, best_of, n)
                yield from self._drain(finished, collectors, best_of, n)
            while collectors:
                with wake:
                    if not finished:
                        wake.wait()
                yield from self._drain(finished, collectors, best_of, n)
        finally:  # the caller stopped early: stop what is still running
            for cols in collectors.values():
                for c in cols:
                    if getattr(c, "req", None) is not None and not c.done.is_set():
                        self.engine.cancel(c.req)

    @staticmethod
    def _drain(finished: list[int], collectors: dict[int, list[Collector]], best_of: int, n: int):
        while finished:
            i = finished.pop(0)
            results = [c.result() for c in collectors.pop(i)]
            yield i, (best(results, n) if best_of > n else results)

    def complete_many(self, prompts: Sequence[Prompt], params: Union[SamplingParams, Sequence[SamplingParams]],
                      n: int = 1, best_of: Optional[int] = None) -> list[list[Completion]]:
        """Blocking: n completions per prompt, in prompt order."""
        out: list[Optional[list[Completion]]] = [None] * len(prompts)
        for i, completions in self.iter_complete(prompts, params, n=n, best_of=best_of):
            out[i] = completions
        return out  # type: ignore[return-value]

    # ---- shared ----
    def choice_params(self, params: SamplingParams, count: int, n: Optional[int] = None) -> list[SamplingParams]:
        """`count` copies with distinct seeds: choice 0 keeps `seed`, the others derive from it. When the best
        `n` < count are kept, they are ranked by cumulative_logprob: the tokens are scored."""
        if n is not None and n < count:
            params = params.replace(score_tokens=True)
        if params.seed is None:
            return [params.replace(seed=self._rng.getrandbits(31)) for _ in range(count)]
        # OpenAI seeds are any int64; SeedSequence takes only non-negative entropy
        entropy = params.seed % 2 ** 64
        seeds = [params.seed] + [int(s) for s in np.random.SeedSequence(entropy).generate_state(count)[1:]
                                 & 0x7FFFFFFF]
        return [params.replace(seed=s) for s in seeds]

    def stats(self) -> dict:
        """Engine counters for metrics: queue_length, running, num_slots, steps, tokens_per_step, ..."""
        s = self.engine.stats()
        return {**dataclasses.asdict(s), "tokens_per_step": s.tokens_per_step}

    def check_health(self) -> None:
        """Raise RuntimeError saying why this generator cannot serve (closed; the engine's thread dead or
        stuck; the slot model's own check): what /health and Ray Serve's replica health check call."""
        if self._closed:
            raise RuntimeError("generator closed")
        self.engine.check_health()

    def close(self) -> None:
        self._closed = True
        self._beams.close()
        self.engine.close()

    def _settings(self, params: SamplingParams) -> SlotSettings:
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        return SlotSettings(
            max_tokens=params.max_tokens, min_tokens=params.min_tokens, temperature=float(params.temperature),
            top_k=params.top_k, top_p=float(params.top_p), min_p=float(params.min_p),
            presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            repetition_penalty=float(params.repetition_penalty), seed=seed,
            stop_token_ids=stop_ids(params, self.eos_token_id),
            bad_words_ids=tuple(tuple(w) for w in params.bad_words_ids),
            no_repeat_ngram_size=params.no_repeat_ngram_size,
            prompt_logprobs=(params.echo and params.logprobs is not None) or params.prompt_logprobs is not None,
            logprob=params.scored, top_logprobs=bool(params.logprobs),
            logit_bias=tuple(sorted((params.logit_bias or {}).items())),
            grammar=None if params.structured is None else grammar_of(params.structured), lora=params.lora)

    def _start(self, prompt: Prompt, params: SamplingParams, sink: Callable[[Any], None],
               ids: list[int]) -> EngineRequest:
        """Submit a prepared request; its text state feeds `sink`."""
        settings = self._settings(params)
        hidden = self._added_tokens(prompt, ids) if params.echo else 0
        token_text = _id_text if params.tokens_as_ids else self.token_text
        state = RequestText(self.tokenizer, token_text, ids, self.decode(ids), params, settings, sink, hidden)
        req = self.engine.submit(ids, settings, state.on_output)
        if isinstance(sink, Collector):
            sink.req = req  # type: ignore[attr-defined]
        return req


def _id_text(token_id: int) -> str:
    """A token as vLLM's return_tokens_as_token_ids names it in logprobs."""
    return f"token_id:{token_id}"
