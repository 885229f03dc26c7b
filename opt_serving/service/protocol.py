"""Request and response shapes of the three HTTP APIs, as pydantic models.

- OpenAI `POST /v1/completions` (+ `GET /v1/models`): what the `openai` client sends, with vLLM's extensions;
  the fields it shares with OpenAI's chat completions (protocol_chat.py) are protocol_sampling.py's.
- metaseq / Alpa `POST /completions`: the same prompt forms, OpenAI-like choices that always carry logprobs.
- GPT-J REST API `POST /generate`: the `post_data` body, answered with `{"gen_text": [...]}`.

Requests are strict (a string is not an int, 1 is not `true`) so wrong types are a 400, not a guess.
Fields OpenAI documents as nullable accept `null` meaning "the default".
A request's own inconsistencies are InvalidRequest errors naming the field (errors.py answers them 400);
checks that need the model (prompt + max_tokens <= max_seq_len, token ids < vocab) are the generator's.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, Field, model_validator

from opt_serving.errors import InvalidRequest
# the fields every sampling route shares (here for the routes, as P.Structured, P.Usage, ...)
from opt_serving.service.protocol_sampling import (JsonSchemaFormat, OpenAISampling, PromptLogprob,  # noqa: F401
                                                   PromptTokensDetails, Request, ResponseFormat, StreamOptions,
                                                   Structured, StructuredOutputs, TokenId, Usage, _stop_list,
                                                   logit_bias_ids, omitted_if_none, prompt_logprobs_of, usage)
# a request's limits are request.py's, whichever way it comes in; the server's own logprobs limit may be lower
from opt_serving.text.request import (LEGACY_MAX_LOGPROBS, MAX_LOGPROBS, MAX_N, MAX_PROMPTS, MAX_STOP,  # noqa: F401
                                 MAX_STOP_TOKEN_IDS)
# OpenAI's four prompt forms; the order matters: a list of ints must not be read as a list of lists.
Prompt = Union[str, list[str], list[TokenId], list[list[TokenId]]]


def normalize_prompt(prompt: Prompt) -> list[str | list[int]]:
    """Any of the four prompt forms -> a list of single prompts (text or token ids); empty ones are refused."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise InvalidRequest("prompt must not be an empty list", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InvalidRequest(f"prompt {i} is empty" if len(prompts) > 1 else "prompt must not be empty",
                                 param="prompt")
    return prompts


# ---------------------------------------------------------------- OpenAI /v1/completions
class CompletionRequest(OpenAISampling):
    """OpenAI's legacy completions request (https://platform.openai.com/docs/api-reference/completions), with
    vLLM's extensions (OpenAISampling)."""
    prompt: Prompt
    max_tokens: Optional[Annotated[int, Field(ge=0, le=1_000_000)]] = 16
    best_of: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = None
    logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        # pydantic turns an InvalidRequest here into a 400, its param naming the field
        n, best_of = self.n or 1, self.best_of
        if best_of is not None and best_of < n:
            raise InvalidRequest(f"best_of ({best_of}) must be greater than or equal to n ({n})", param="best_of")
        if self.stream and best_of is not None and best_of > n:
            raise InvalidRequest("best_of > n cannot be combined with stream", param="best_of")
        if self.use_beam_search and best_of is not None and best_of > n:
            raise InvalidRequest("best_of > n cannot be combined with use_beam_search (the n beams are the best)",
                                 param="best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        self.check_sampling(16 if self.max_tokens is None else self.max_tokens)
        normalize_prompt(self.prompt)
        return self


class Logprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: list[Optional[dict[str, float]]] = []
    text_offset: list[int] = []

    @classmethod
    def of(cls, c, **extra):
        """A generator Completion's or Delta's token lists."""
        return cls(tokens=list(c.tokens), token_logprobs=list(c.token_logprobs),
                   top_logprobs=list(c.top_logprobs or []), text_offset=list(c.text_offset), **extra)


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: Optional[Logprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    prompt_logprobs: Optional[list[Optional[dict[str, PromptLogprob]]]] = None
    # vLLM's return_token_ids: the tokens generated (EOS included), and the prompt's (in a stream's first chunk)
    token_ids: Optional[list[int]] = omitted_if_none()
    prompt_token_ids: Optional[list[int]] = omitted_if_none()


def _completion_id() -> str:
    return "cmpl-" + uuid.uuid4().hex


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=_completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "opt_serving"
    max_model_len: Optional[int] = None
    root: Optional[str] = None    # vLLM's: a LoRA adapter's folder (the model's own name for the base model)
    parent: Optional[str] = None  # vLLM's: the base model a LoRA adapter runs on (None for the base model)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- metaseq / Alpa /completions
class MetaseqRequest(Structured):
    """metaseq's interactive_hosted / Alpa's llm_serving `completions` body (lenient defaults like theirs)."""
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0, le=1_000_000)] = 32
    min_tokens: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    best_of: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = None
    echo: bool = False
    stop: Optional[Union[str, Annotated[list[str], Field(max_length=MAX_STOP)]]] = None
    logprobs: Annotated[int, Field(ge=0, le=LEGACY_MAX_LOGPROBS)] = 0
    seed: Optional[int] = None

    @model_validator(mode="after")
    def _check(self) -> "MetaseqRequest":
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequest(f"best_of ({self.best_of}) must be greater than or equal to n ({self.n})",
                                 param="best_of")
        self.structured()
        _stop_list(self.stop)
        normalize_prompt(self.prompt)
        return self


class MetaseqLogprobs(Logprobs):
    # metaseq put finish_reason inside logprobs; kept for its clients, also given on the choice
    finish_reason: Literal["stop", "length"] = "length"


class MetaseqChoice(BaseModel):
    text: str
    index: int
    logprobs: MetaseqLogprobs
    finish_reason: Literal["stop", "length"]


class MetaseqResponse(BaseModel):
    id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[MetaseqChoice]


# ---------------------------------------------------------------- GPT-J REST API /generate
class GenerateRequest(Structured):
    """GPT-API's `post_data` (seeds/002): same fields and defaults; lengths count new tokens.
    `do_sample=false, num_beams > 1` is beam search (HF's, early_stop is its `early_stopping`); beam sampling
    (num_beams > 1 with do_sample) and contrastive search (penalty_alpha) are refused with a 400."""
    prompt: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)] = [
        "Hello world"]
    bad_words: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=256)] = []
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_k: Annotated[float, Field(ge=0, le=1_000_000)] = 50
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    min_length: Annotated[int, Field(ge=0, le=1_000_000)] = 10
    max_length: Annotated[int, Field(ge=1, le=1_000_000)] = 50
    penalty_alpha: float = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    early_stop: bool = False
    end_sequence: str = ""
    do_sample: bool = True
    num_beams: Annotated[int, Field(ge=0, le=64)] = 0
    return_prompt: str = ""
    seed: int = -1

    @model_validator(mode="after")
    def _check(self) -> "GenerateRequest":
        if self.min_length > self.max_length:
            raise InvalidRequest(f"min_length ({self.min_length}) must not exceed max_length ({self.max_length})",
                                 param="min_length")
        if self.penalty_alpha != 0.0:
            raise InvalidRequest("penalty_alpha (contrastive search) is not supported by this server",
                                 param="penalty_alpha")
        if self.num_beams > 1 and self.do_sample and self.temperature > 0:
            raise InvalidRequest("num_beams > 1 with do_sample=true (beam sampling) is not supported; "
                                 "set do_sample=false for beam search", param="num_beams")
        if self.top_k != int(self.top_k):
            raise InvalidRequest("top_k must be a whole number", param="top_k")
        self.structured()
        return self


class GenerateResponse(BaseModel):
    gen_text: list[str]


# ---------------------------------------------------------------- errors (OpenAI's shape)
class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def error_json(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code)).model_dump()


# ---------------------------------------------------------------- vLLM's /tokenize and /detokenize
class LoadLoraAdapterRequest(Request):
    """vLLM's `POST /v1/load_lora_adapter`: serve the PEFT adapter folder at `lora_path` as `lora_name`."""
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(Request):
    """vLLM's `POST /v1/unload_lora_adapter`."""
    lora_name: str
    lora_int_id: Optional[int] = None  # (vLLM's; adapters are named here)


class TokenizeRequest(Request):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(Request):
    model: Optional[str] = None
    tokens: Annotated[list[TokenId], Field(max_length=1_000_000)]


class DetokenizeResponse(BaseModel):
    prompt: str
