"""What a completion request may ask for, its limits, and the one place it is checked.

Every front end maps its own request shape onto `SamplingParams` (the HTTP routes, the batch runner's jsonl
lines, library callers) and every check below raises `errors.InvalidRequest` naming the field at fault in
`param`, so a bad request is refused with the same message whichever way it came in:

  * `SamplingParams.validate()`: each field's type and range, needing no model;
  * `check_for_model(params, limits)`: what depends on the model served (its vocabulary, its top
    alternatives, its EOS);
  * `prompt_form(prompt)`: a non-empty text or list of token ids; `refuse_surely_too_long(...)`: a text
    too long to fit however it tokenises, refused without tokenising it;
  * `truncate_prompt(ids, params, max_seq_len)`: vLLM's truncate_prompt_tokens, once the prompt is tokenised;
  * `check_prompt(ids, max_tokens, vocab_size, max_seq_len)`: the tokenised prompt fits the vocabulary and the
    context (the engine calls it too: these are the slot model's invariants, so it and `check_bad_words` are
    defined with the engine's types, engine/types.py, and re-exported here);
  * `check_n(n, best_of)`: how many samples a prompt asks for.
`Checker.prepare` (checking.py; a `Generator` is one) and `prepare_many`, the batch runner's, run them in that
order.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Optional, Sequence, Union

from opt_serving.engine.types import check_bad_words, check_prompt
from opt_serving.errors import ContextLengthExceeded, InvalidRequest
from opt_serving.runner.types import MAX_BAD_WORD_LEN, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from opt_serving.text.structured import StructuredOutput

Prompt = Union[str, Sequence[int]]

# ---- limits ----
MAX_N = 16                 # HTTP: completions per prompt (n and best_of)
BATCH_MAX_N = 128          # the batch runner: a file line may ask for more, nobody waits on it
MAX_PROMPTS = 64           # HTTP: prompts per request
MAX_STOP = 4               # stop strings (OpenAI's limit)
MAX_LOGPROBS = MAX_TOP_LOGPROBS  # top alternatives per token: what the slot model computes (vLLM's default)
LEGACY_MAX_LOGPROBS = 5    # OpenAI's legacy completions and metaseq: the batch runner's file format
MAX_STOP_TOKEN_IDS = 64
MAX_NO_REPEAT_NGRAM = 8    # sampling.MAX_NGRAM: the decode step unrolls the n-gram match to this length
# MAX_BAD_WORDS, MAX_BAD_WORD_LEN, MAX_LOGIT_BIAS (runner.types): bad words and logit biases live in fixed-shape
# per-slot arrays
MAX_ABS_LOGIT_BIAS = 100   # OpenAI's range for a logit_bias value

__all__ = ["BATCH_MAX_N", "LEGACY_MAX_LOGPROBS", "MAX_ABS_LOGIT_BIAS", "MAX_BAD_WORDS", "MAX_BAD_WORD_LEN",
           "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_N",
           "MAX_NO_REPEAT_NGRAM", "MAX_PROMPTS", "MAX_STOP", "MAX_STOP_TOKEN_IDS", "ModelLimits", "Prompt",
           "SamplingParams", "check_bad_words", "check_for_model", "check_logit_bias", "check_n", "check_prompt",
           "prompt_form", "refuse_surely_too_long", "stop_ids", "truncate_prompt"]


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    min_p: float = 0.0              # 0 = off; vLLM's: tokens below min_p x the top probability are dropped
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None      # None: a fresh random seed per request
    stop: list[str] = dataclasses.field(default_factory=list)
    logprobs: Optional[int] = None  # None: no scores; 0: the chosen tokens' logprobs; k: and k alternatives
    # the chosen tokens' logprobs and cumulative_logprob even when `logprobs` is None: True for a caller whose
    # answer always shows them (the batch runner's format). None (or False): only where the request needs
    # them (`logprobs`, or best_of ranking by them). Unscored, a step where every request is plainly greedy
    # can skip the logits (the CPU's screened greedy head)
    score_tokens: Optional[bool] = None
    echo: bool = False
    bad_words_ids: list[list[int]] = dataclasses.field(default_factory=list)  # HF's bad_words_ids
    no_repeat_ngram_size: int = 0
    ignore_eos: bool = False
    # vLLM's extensions, with vLLM's meaning: more token ids that end the completion "stop" (as EOS does,
    # held back by min_tokens; EOS itself stays one unless ignore_eos); a stop string or stop token's text kept
    # at the end of the text; special tokens (</s>) written into the text instead of dropped
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's prompt_logprobs: each prompt token's logprob, rank and this many top alternatives (None: off)
    prompt_logprobs: Optional[int] = None
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit before sampling
    logit_bias: Optional[dict[int, float]] = None
    # structured output: what the text must follow (structured.py)
    structured: Optional[StructuredOutput] = None
    # vLLM's truncate_prompt_tokens: keep this many of the tokenised prompt's tokens (None: all), the last ones
    # (truncation_side "left", vLLM's default) or the first ("right"); -1: as many as fit beside max_tokens
    truncate_prompt_tokens: Optional[int] = None
    truncation_side: str = "left"
    # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>" rather than by its text, for
    # clients that map them back to ids (a token's text may not say which id it was)
    tokens_as_ids: bool = False
    # the LoRA adapter to run with, by the name it is served under (an OpenAI request names it as its `model`,
    # as vLLM's do); None: the base model. Whether it is served is the generator's check (check_lora)
    lora: Optional[str] = None

    @property
    def scored(self) -> bool:
        """Whether the chosen tokens' logprobs are computed (see score_tokens)."""
        return self.logprobs is not None or bool(self.score_tokens)

    def validate(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Raise InvalidRequest naming the first bad field (types are strict: true is not 1, "5" not 5).
        `max_logprobs`: the front end's own limit (the model's is `check_for_model`'s)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _integer("max_tokens", self.max_tokens, 0)
        _flag("echo", self.echo)
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens must be >= 1 (0 only with echo, to score the prompt)",
                                 param="max_tokens")
        _integer("min_tokens", self.min_tokens, 0, self.max_tokens)
        _number("temperature", self.temperature, 0)
        _number("top_p", self.top_p, 0, 1, open_lo=True)
        _integer("top_k", self.top_k, 0)
        _number("min_p", self.min_p, 0, 1)
        _number("presence_penalty", self.presence_penalty, -2, 2)
        _number("frequency_penalty", self.frequency_penalty, -2, 2)
        _number("repetition_penalty", self.repetition_penalty, 0, open_lo=True)
        if self.seed is not None:
            _integer("seed", self.seed)
        if not (isinstance(self.stop, (list, tuple)) and len(self.stop) <= MAX_STOP
                and all(isinstance(s, str) and s for s in self.stop)):
            raise InvalidRequest(f"stop must be a string or a list of at most {MAX_STOP} non-empty strings, "
                                 f"got {self.stop!r:.80}", param="stop")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, max_logprobs)
        if self.score_tokens is not None:
            _flag("score_tokens", self.score_tokens)
        check_bad_words(self.bad_words_ids)
        _integer("no_repeat_ngram_size", self.no_repeat_ngram_size, 0, MAX_NO_REPEAT_NGRAM)
        if not (isinstance(self.stop_token_ids, (list, tuple)) and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
                and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)):
            raise InvalidRequest(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids "
                                 f"(integers >= 0), got {self.stop_token_ids!r:.80}", param="stop_token_ids")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _flag(name, getattr(self, name))
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, 0, max_logprobs)
        check_logit_bias(self.logit_bias)
        if self.truncate_prompt_tokens is not None:
            _integer("truncate_prompt_tokens", self.truncate_prompt_tokens, -1)
        if self.truncation_side not in ("left", "right"):
            raise InvalidRequest(f"truncation_side must be \"left\" or \"right\", got {self.truncation_side!r:.40}",
                                 param="truncation_side")
        _flag("tokens_as_ids", self.tokens_as_ids)
        if self.lora is not None and not (isinstance(self.lora, str) and self.lora):
            raise InvalidRequest(f"lora must be an adapter's name, got {self.lora!r:.60}", param="model")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequest(f"structured must be a StructuredOutput, got {self.structured!r:.60}",
                                 param="structured_outputs")

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against that depends on the model served."""
    vocab_size: int
    max_seq_len: int                       # prompt + generated tokens of one request
    max_top_logprobs: int = MAX_TOP_LOGPROBS
    eos_token_id: Optional[int] = None


def stop_ids(params: SamplingParams, eos_token_id: Optional[int]) -> tuple[int, ...]:
    """The token ids that finish a request "stop": EOS (unless ignore_eos) first, since the slot model holds
    back the first of them until min_tokens, then stop_token_ids."""
    eos = () if params.ignore_eos or eos_token_id is None else (eos_token_id,)
    return tuple(dict.fromkeys([*eos, *params.stop_token_ids]))


def check_for_model(params: SamplingParams, limits: ModelLimits) -> None:
    """The checks of a (validated) request that depend on the model: raise InvalidRequest naming the field."""
    most = limits.max_top_logprobs
    if params.logprobs is not None and params.logprobs > most:
        raise InvalidRequest(f"logprobs: at most {most} alternatives per token with this model, got "
                             f"{params.logprobs}", param="logprobs")
    if params.prompt_logprobs is not None and params.prompt_logprobs > most:
        raise InvalidRequest(f"prompt_logprobs: at most {most} alternatives per token with this model, got "
                             f"{params.prompt_logprobs}", param="prompt_logprobs")
    vocab = limits.vocab_size
    bad = [t for t in params.logit_bias or () if t >= vocab]
    if bad:
        raise InvalidRequest(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})",
                             param="logit_bias")
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise InvalidRequest(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab})",
                             param="stop_token_ids")
    bad = [t for w in params.bad_words_ids for t in w if t >= vocab]
    if bad:
        raise InvalidRequest(f"bad_words_ids: {bad[0]} is outside the vocabulary [0, {vocab})",
                             param="bad_words_ids")
    if params.min_tokens and len(stop_ids(params, limits.eos_token_id)) > 1:
        # the slot model holds back one stop token (sampling.held_back); another could not be kept out
        raise InvalidRequest("stop_token_ids: with min_tokens, only one stop token is supported (EOS, or one "
                             "stop_token_ids entry with ignore_eos)", param="stop_token_ids")


def prompt_form(prompt: Any) -> Union[str, list[int]]:
    """A prompt as the generator takes it: a non-empty string, or token ids as a list of ints (numpy's
    included); InvalidRequest otherwise."""
    if isinstance(prompt, str):
        if prompt:
            return prompt
    elif isinstance(prompt, Sequence) or hasattr(prompt, "__array__"):
        ids = list(prompt)
        if ids and all(_is_int(t) and t >= 0 for t in ids):
            return [int(t) for t in ids]
    raise InvalidRequest("prompt must be a non-empty string or a non-empty list of token ids (integers >= 0), "
                         f"got {prompt!r:.60}", param="prompt")


def refuse_surely_too_long(text: str, max_tokens: int, max_seq_len: int, max_token_chars: Optional[int]) -> None:
    """A text that cannot fit whatever it tokenises to is refused before tokenising (which would take
    seconds for megabytes): each token covers at most `max_token_chars` characters (None: no bound known)."""
    room = max_seq_len - max_tokens
    if max_token_chars is not None and len(text) > max_token_chars * room:
        raise ContextLengthExceeded(f"this model's maximum context length is {max_seq_len} tokens, but the "
                                    f"prompt has {len(text)} characters, more than {room} tokens (with "
                                    f"max_tokens {max_tokens}) can hold; it was not tokenised")


def truncate_prompt(ids: list[int], params: SamplingParams, max_seq_len: int) -> list[int]:
    """The prompt's ids as `truncate_prompt_tokens` keeps them (vLLM's meaning: the last ones, or the first with
    truncation_side "right"; -1: as many as fit beside max_tokens); InvalidRequest when more are asked to be kept
    than fit beside max_tokens (vLLM refuses that too)."""
    keep = params.truncate_prompt_tokens
    room = max_seq_len - params.max_tokens
    if keep is None or room < 1:  # (no room at all: check_prompt says the context is exceeded)
        return ids
    if keep == -1:
        keep = room
    elif keep > room:
        raise InvalidRequest(f"truncate_prompt_tokens ({keep}) must be at most this model's maximum context length "
                             f"({max_seq_len}) minus max_tokens ({params.max_tokens}): {room}",
                             param="truncate_prompt_tokens")
    if len(ids) <= keep:
        return ids
    return ids[len(ids) - keep:] if params.truncation_side == "left" else ids[:keep]


def check_logit_bias(bias: Any) -> None:
    """OpenAI's logit_bias: at most MAX_LOGIT_BIAS token ids (integers >= 0), each with a number in [-100, 100]."""
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise InvalidRequest(f"logit_bias must map token ids to biases, got {bias!r:.60}", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}", param="logit_bias")
    for token, value in bias.items():
        if not (_is_int(token) and token >= 0):
            raise InvalidRequest(f"logit_bias: invalid key {token!r:.40}: keys must be token ids (integers >= 0)",
                                 param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not abs(value) <= MAX_ABS_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias: the bias of token {token} must be a number in "
                                 f"[-{MAX_ABS_LOGIT_BIAS}, {MAX_ABS_LOGIT_BIAS}], got {value!r:.40}",
                                 param="logit_bias")


def check_n(n: Any, best_of: Any = None, max_n: Optional[int] = None) -> int:
    """Check n and best_of (default n, at least n; both at most max_n); return best_of."""
    _integer("n", n, 1, max_n)
    best_of = n if best_of is None else best_of
    _integer("best_of", best_of, 1, max_n)
    if best_of < n:
        raise InvalidRequest(f"best_of ({best_of}) must be >= n ({n})", param="best_of")
    return best_of


# ---- field checks ----

def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _flag(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise InvalidRequest(f"{name} must be true or false, got {v!r:.60}", param=name)


def _integer(name: str, v: Any, lo: Optional[int] = None, hi: Optional[int] = None) -> None:
    if not _is_int(v):
        raise InvalidRequest(f"{name} must be an integer, got {v!r:.60}", param=name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidRequest(f"{name} must be {_range(lo, hi)}, got {v}", param=name)


def _number(name: str, v: Any, lo: float, hi: Optional[float] = None, open_lo: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise InvalidRequest(f"{name} must be a number, got {v!r:.60}", param=name)
    if not ((v > lo if open_lo else v >= lo) and (hi is None or v <= hi)):  # NaN fails both
        raise InvalidRequest(f"{name} must be {_range(lo, hi, open_lo)}, got {v}", param=name)


def _range(lo: Optional[float], hi: Optional[float], open_lo: bool = False) -> str:
    if hi is None:
        return f"{'>' if open_lo else '>='} {lo:g}"
    if lo is None:
        return f"<= {hi:g}"
    return f"in {'(' if open_lo else '['}{lo:g}, {hi:g}]"
