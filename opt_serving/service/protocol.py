"""Request and response shapes of the three HTTP APIs, as pydantic models.

- OpenAI `POST /v1/completions` (+ `GET /v1/models`): what the `openai` client sends.
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

from pydantic import BaseModel, ConfigDict, Field, model_validator

from opt_serving.errors import InvalidRequest
# a request's limits are request.py's, whichever way it comes in; the server's own logprobs limit may be lower
from opt_serving.text.request import (LEGACY_MAX_LOGPROBS, MAX_LOGPROBS, MAX_N, MAX_PROMPTS, MAX_STOP,  # noqa: F401
                                 MAX_STOP_TOKEN_IDS, check_logit_bias)
from opt_serving.text.structured import StructuredOutput

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
# OpenAI's four prompt forms; the order matters: a list of ints must not be read as a list of lists.
Prompt = Union[str, list[str], list[TokenId], list[list[TokenId]]]


class Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


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


def _stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise InvalidRequest(f"stop: at most {MAX_STOP} stop sequences, got {len(stops)}", param="stop")
    if any(s == "" for s in stops):
        raise InvalidRequest("stop: stop sequences must not be empty strings", param="stop")
    return stops


# ---------------------------------------------------------------- structured output (every route that samples)
class JsonSchemaFormat(Request):
    """OpenAI's response_format.json_schema."""
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = "schema"
    description: Optional[str] = None
    schema_: Optional[Union[dict, bool]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Request):
    """OpenAI's response_format, which vLLM takes on /v1/completions too: text, any JSON object, or a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(Request):
    """vLLM's structured_outputs: one of json (a schema), regex, choice, grammar (Lark or GBNF), json_object."""
    json_: Optional[Union[dict, bool, str]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False   # (ours never allows free whitespace unless whitespace_pattern asks)
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None
    disable_fallback: bool = False         # (one library here: there is nothing to fall back to)


class Structured(Request):
    """The structured-output fields every sampling route takes: OpenAI's response_format, vLLM's
    structured_outputs, and vLLM's older guided_* fields."""
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[dict, bool, str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    guided_decoding_backend: Optional[str] = None  # (one library here: llguidance)

    def structured(self) -> Optional[StructuredOutput]:
        """The one constraint asked for (None: none); InvalidRequest for two, or for one that is malformed."""
        so, rf = self.structured_outputs, self.response_format
        asked = []  # (kind, value, field)
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequest("response_format: type json_schema needs json_schema.schema",
                                     param="response_format")
            asked.append(("json", rf.json_schema.schema_, "response_format"))
        elif rf is not None and rf.type == "json_object":
            asked.append(("json_object", None, "response_format"))
        if so is not None:
            if so.structural_tag is not None:
                raise InvalidRequest("structured_outputs: structural_tag is not supported by this server",
                                     param="structured_outputs")
            for kind, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                ("grammar", so.grammar), ("json_object", so.json_object or None)):
                if value is not None:
                    asked.append((kind, value, "structured_outputs"))
        for kind, value in (("json", self.guided_json), ("regex", self.guided_regex),
                            ("choice", self.guided_choice), ("grammar", self.guided_grammar)):
            if value is not None:
                asked.append((kind, value, "guided_" + kind))
        if len(asked) > 1:
            raise InvalidRequest("only one kind of structured output constraint per request (response_format, "
                                 f"structured_outputs json/regex/choice/grammar/json_object, guided_*), got "
                                 f"{', '.join(f'{f} {k}' for k, _, f in asked)}", param=asked[1][2])
        if not asked:
            return None
        kind, value, field = asked[0]
        pattern = (so.whitespace_pattern if so is not None else None) or self.guided_whitespace_pattern
        return StructuredOutput.of(kind, value, field, whitespace_pattern=pattern,
                                   disable_additional_properties=bool(so and so.disable_additional_properties))


def logit_bias_ids(bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    """OpenAI's logit_bias (token ids as JSON keys) -> {token id: bias}; InvalidRequest naming a bad entry."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise InvalidRequest(f"logit_bias: invalid key {key!r:.40}: keys must be token ids (integers >= 0)",
                                 param="logit_bias")
        out[int(key)] = value
    check_logit_bias(out)
    return out


# ---------------------------------------------------------------- OpenAI /v1/completions
class StreamOptions(Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's (accepted; usage comes once, at the end)


class CompletionRequest(Structured):
    """OpenAI's legacy completions request (https://platform.openai.com/docs/api-reference/completions)."""
    model: Optional[str] = None
    prompt: Prompt
    max_tokens: Optional[Annotated[int, Field(ge=0, le=1_000_000)]] = 16
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = 1.0
    top_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = 1.0
    n: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = 1
    best_of: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    echo: Optional[bool] = False
    stop: Optional[Union[Annotated[str, Field(max_length=256)],
                         Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=MAX_STOP)]]] = None
    seed: Optional[Annotated[int, Field(ge=-(2**63), lt=2**64)]] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = 0.0
    frequency_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = 0.0
    logit_bias: Optional[dict[str, Union[float, int]]] = None
    suffix: Optional[str] = None
    user: Optional[str] = None
    # vLLM's sampling extensions, with vLLM's meaning and checks (its SamplingParams); null = the default
    top_k: Optional[Annotated[int, Field(ge=-1, lt=2**31)]] = None   # -1 or 0: off
    min_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None  # 0: off
    min_tokens: Optional[Annotated[int, Field(ge=0, le=1_000_000)]] = None
    ignore_eos: Optional[bool] = None
    repetition_penalty: Optional[Annotated[float, Field(gt=0.0)]] = None
    stop_token_ids: Optional[Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    prompt_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        # pydantic turns an InvalidRequest here into a 400, its param naming the field
        n, best_of = self.n or 1, self.best_of
        if best_of is not None and best_of < n:
            raise InvalidRequest(f"best_of ({best_of}) must be greater than or equal to n ({n})", param="best_of")
        if self.stream and best_of is not None and best_of > n:
            raise InvalidRequest("best_of > n cannot be combined with stream", param="best_of")
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer
            raise InvalidRequest("stream_options can only be set when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequest("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        logit_bias_ids(self.logit_bias)
        self.structured()
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        if (self.min_tokens or 0) > max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must be less than or equal to max_tokens "
                                 f"({max_tokens})", param="min_tokens")
        _stop_list(self.stop)
        normalize_prompt(self.prompt)
        return self

    @property
    def stops(self) -> list[str]:
        return _stop_list(self.stop)

    def extensions(self) -> dict:
        """vLLM's extensions as generator SamplingParams fields (defaults for those not sent)."""
        return dict(top_k=max(self.top_k or 0, 0), min_p=self.min_p or 0.0, min_tokens=self.min_tokens or 0,
                    ignore_eos=bool(self.ignore_eos),
                    repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                    stop_token_ids=list(self.stop_token_ids or []),
                    include_stop_str_in_output=bool(self.include_stop_str_in_output),
                    skip_special_tokens=self.skip_special_tokens is not False,
                    prompt_logprobs=self.prompt_logprobs, logit_bias=logit_bias_ids(self.logit_bias),
                    structured=self.structured())


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


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token of a prompt_logprobs entry."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


def prompt_logprobs_of(scores) -> Optional[list[Optional[dict[str, PromptLogprob]]]]:
    """A Completion's prompt_logprobs (completion.Delta) in vLLM's shape: token ids as keys."""
    if scores is None:
        return None
    return [None if entry is None else {str(t): PromptLogprob(logprob=lp, rank=rank, decoded_token=text)
                                        for t, (lp, rank, text) in entry.items()} for entry in scores]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: Optional[Logprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    prompt_logprobs: Optional[list[Optional[dict[str, PromptLogprob]]]] = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


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
