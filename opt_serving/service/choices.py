"""What `/v1/completions` and `/v1/chat/completions` share, written once: a request's sampling fields ->
the generator's SamplingParams, its choices started (each prompt's best_of samples in the decode slots, or with
vLLM's use_beam_search its n best beams, text/beam.py), and their usage as they stream. The routes differ only in
where the prompt comes from (a prompt, or messages through the chat template) and in the shape of each choice.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from opt_serving.errors import InvalidRequest
from opt_serving.runner.types import MAX_BAD_WORD_LEN, MAX_BAD_WORDS
from opt_serving.service import protocol as P
from opt_serving.service.errors import as_http_errors
from opt_serving.service.routes_gptj import bad_words_ids
from opt_serving.service.serving import Service, greedy_if_no_top_p
from opt_serving.text.beam import BeamSearch


def sampling(svc: Service, req: P.OpenAISampling, max_tokens: int, logprobs: Optional[int],
             echo: bool = False) -> dict:
    """The request's generator SamplingParams fields (OpenAI's nulls meaning the defaults)."""
    temperature, top_p = greedy_if_no_top_p(1.0 if req.temperature is None else req.temperature,
                                            1.0 if req.top_p is None else req.top_p)
    svc.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    return dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                seed=req.seed, stop=req.stops, logprobs=svc.check_logprobs(logprobs), echo=echo,
                bad_words_ids=_bad_words(svc, req.bad_words), lora=svc.lora_of(req.model), **req.extensions())


def _bad_words(svc: Service, words: Optional[list[str]]) -> list[list[int]]:
    """vLLM's bad_words (strings) -> token id sequences (with and without a leading space, as vLLM), within what
    the decode slots hold; InvalidRequest naming bad_words otherwise."""
    ids = bad_words_ids(svc.g, words or [])
    if len(ids) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_LEN for w in ids):
        raise InvalidRequest(f"bad_words: at most {MAX_BAD_WORDS} token sequences of up to {MAX_BAD_WORD_LEN} tokens "
                             f"(each word counts with and without a leading space), got {len(ids)}",
                             param="bad_words")
    return ids


async def start(svc: Service, req: P.OpenAISampling, prompts: list, params: dict, best_of: int) -> list:
    """Every choice of the request started now, prompt after prompt (each prompt's `best_of` candidates; the
    route keeps the best n): sampled in the decode slots, or with use_beam_search the n best beams of one search
    per prompt. Each is a stream of deltas (a beam's: its whole completion once the search ends). Refusals (a
    full queue, a too-long prompt, a beam search over the budget) are HTTP errors before anything streams."""
    n = req.n or 1
    if not req.use_beam_search:
        return await svc.start(svc.jobs(prompts, best_of, n, **params))
    search = BeamSearch(num_beams=n, num_return=n, length_penalty=1.0 if req.length_penalty is None
                        else req.length_penalty)
    base = svc.SamplingParams(**params)
    with as_http_errors():
        base.validate()
        return svc.g.beam_streams([(p, base) for p in prompts], search)


class Tally:
    """The usage of a request's choices as they stream: `n` consecutive choices share a prompt (counted once)."""

    def __init__(self, count: int, n: int):
        self.n = n
        self.generated, self.prompt, self.cached = [0] * count, [0] * count, [0] * count

    def add(self, i: int, d) -> int:
        """A delta of choice i -> how many tokens it brought."""
        new = d.completion_tokens - self.generated[i]
        self.generated[i], self.prompt[i], self.cached[i] = d.completion_tokens, d.prompt_tokens, d.cached_tokens
        return new

    def choice(self, i: int) -> P.Usage:
        """Choice i's usage so far (vLLM's continuous_usage_stats): its prompt and its tokens."""
        return P.usage(self.prompt[i], self.generated[i], self.cached[i])

    def total(self) -> P.Usage:
        return P.usage(sum(self.prompt[::self.n]), sum(self.generated), sum(self.cached[::self.n]))


async def streamed(svc: Service, streams: list, endpoint: str, tally: Tally) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, delta) as the deltas of any choice arrive, counted in `tally` and timed for the metrics as
    `endpoint`. However it ends (done, failed, the client gone), every stream is cancelled."""
    timer = svc.metrics.timer(endpoint)
    merged = svc.merged(streams)
    try:
        async for i, d in merged:
            timer.tokens(tally.add(i, d), i)
            yield i, d
        timer.finish(tally.total().prompt_tokens)
    finally:
        await merged.aclose()
        for st in streams:
            st.cancel()
        timer.finish()


def token_ids(req: P.OpenAISampling, d) -> Optional[list[int]]:
    """A delta's generated token ids where the request asked for them (vLLM's return_token_ids)."""
    return list(d.output_token_ids) if req.return_token_ids else None


def prompt_token_ids(req: P.OpenAISampling, d) -> Optional[list[int]]:
    """The prompt's ids (in a choice's first delta) where the request asked for them."""
    return d.prompt_token_ids if req.return_token_ids else None
