"""The request fields every sampling route shares (protocol.py re-exports them): structured output (OpenAI's
response_format, vLLM's structured_outputs and guided_* fields), and `OpenAISampling`, what OpenAI's
`/v1/completions` and `/v1/chat/completions` both take with vLLM's extensions to them, answered with the same
`Usage`.

Requests are strict (a string is not an int, 1 is not `true`) so wrong types are a 400, not a guess; a field
we know but cannot honour is a 400 naming it.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from opt_serving.errors import InvalidRequest
from opt_serving.text.request import MAX_LOGPROBS, MAX_N, MAX_STOP, MAX_STOP_TOKEN_IDS, check_logit_bias
from opt_serving.text.structured import StructuredOutput

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
MAX_BAD_WORDS = 64  # vLLM's bad_words (strings): each becomes one or two token sequences (text/request.py's limit)


class Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


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


# ---------------------------------------------------------------- OpenAI completions and chat completions
class StreamOptions(Request):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False  # vLLM's: usage on every chunk too (with include_usage)


class OpenAISampling(Structured):
    """What /v1/completions and /v1/chat/completions both take (OpenAI's fields and vLLM's extensions to them,
    with vLLM's meaning and checks); null means the default. Each route adds its prompt, its length and logprobs
    fields, and calls `check_sampling()` from its own validator."""
    model: Optional[str] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = 1.0
    top_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = 1.0
    n: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[Annotated[str, Field(max_length=256)],
                         Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=MAX_STOP)]]] = None
    seed: Optional[Annotated[int, Field(ge=-(2**63), lt=2**64)]] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = 0.0
    frequency_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = 0.0
    logit_bias: Optional[dict[str, Union[float, int]]] = None
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
    bad_words: Optional[Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]],
                                  Field(max_length=MAX_BAD_WORDS)]] = None
    # the beam search of text/beam.py instead of sampling: n beams, the n best returned (vLLM's beam_width = n)
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    # the prompt's tokens kept (vLLM's: the last ones, or the first with truncation_side "right"; -1: what fits)
    truncate_prompt_tokens: Optional[Annotated[int, Field(ge=-1, le=2**31)]] = None
    truncation_side: Optional[Literal["left", "right"]] = None
    return_token_ids: Optional[bool] = None            # token_ids (generated) and prompt_token_ids in the answer
    return_tokens_as_token_ids: Optional[bool] = None  # logprobs name tokens "token_id:<id>"

    def check_sampling(self, max_tokens: Optional[int]) -> None:
        """The checks both routes share (InvalidRequest naming the field; pydantic answers it 400).
        `max_tokens`: the request's, where it gives one."""
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer
            raise InvalidRequest("stream_options can only be set when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequest("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        if max_tokens is not None and (self.min_tokens or 0) > max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must be less than or equal to max_tokens "
                                 f"({max_tokens})", param="min_tokens")
        if self.length_penalty not in (None, 1.0) and not self.use_beam_search:  # (vLLM's clients send its 1.0)
            raise InvalidRequest("length_penalty goes with use_beam_search", param="length_penalty")
        logit_bias_ids(self.logit_bias)
        self.structured()
        _stop_list(self.stop)

    @property
    def stops(self) -> list[str]:
        return _stop_list(self.stop)

    @property
    def usage_options(self) -> tuple[bool, bool]:
        """(usage chunk at the end of a stream, usage on every chunk too): stream_options'."""
        o = self.stream_options
        final = bool(o and o.include_usage)
        return final, final and bool(o.continuous_usage_stats)

    def extensions(self) -> dict:
        """vLLM's extensions as generator SamplingParams fields (defaults for those not sent)."""
        return dict(top_k=max(self.top_k or 0, 0), min_p=self.min_p or 0.0, min_tokens=self.min_tokens or 0,
                    ignore_eos=bool(self.ignore_eos),
                    repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                    stop_token_ids=list(self.stop_token_ids or []),
                    include_stop_str_in_output=bool(self.include_stop_str_in_output),
                    skip_special_tokens=self.skip_special_tokens is not False,
                    prompt_logprobs=self.prompt_logprobs, logit_bias=logit_bias_ids(self.logit_bias),
                    structured=self.structured(), truncate_prompt_tokens=self.truncate_prompt_tokens,
                    truncation_side=self.truncation_side or "left",
                    tokens_as_ids=bool(self.return_tokens_as_token_ids))


# ---------------------------------------------------------------- what both answer
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


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


def usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def omitted_if_none(default=None, **kwargs):
    """A field left out of the JSON when it is None (vLLM's extensions a client did not ask for: the answer
    keeps OpenAI's shape)."""
    return Field(default=default, exclude_if=lambda v: v is None, **kwargs)
