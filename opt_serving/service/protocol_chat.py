"""OpenAI's chat completions, `POST /v1/chat/completions`, as the `openai` client and vLLM shape them: the
request (messages, and the sampling fields /v1/completions takes too: protocol_sampling.OpenAISampling) and the
answer, a JSON body or `chat.completion.chunk` events."""
from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from opt_serving.errors import InvalidRequest
from opt_serving.service.protocol_sampling import (OpenAISampling, PromptLogprob, Request, Usage,
                                                   omitted_if_none)
from opt_serving.text.request import MAX_LOGPROBS

MAX_MESSAGES = 4096


class ContentPart(Request):
    """One part of a message's content; only text parts are for a text model."""
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    """A message as the template sees it: its role and content, and whatever else it carries (a template may
    read `name`, `tool_calls`, `tool_call_id`, ...)."""
    model_config = ConfigDict(strict=True, extra="allow")
    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: Optional[Union[str, list[ContentPart]]] = None

    def for_template(self, i: int) -> dict:
        """The message as a dict for the chat template, a list of text parts joined into one string (as vLLM
        gives a template that reads the content as a string); InvalidRequest naming a part that is not text."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(f"messages[{i}].content[{j}]: only text parts (type \"text\") can be read "
                                         f"by this model, got type {part.type!r:.40}", param="messages")
            message["content"] = "\n".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(OpenAISampling):
    """OpenAI's chat completions request (https://platform.openai.com/docs/api-reference/chat/create) with vLLM's
    extensions: the chat template's options, and the sampling ones /v1/completions takes."""
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1, le=1_000_000)]] = None
    max_tokens: Optional[Annotated[int, Field(ge=1, le=1_000_000)]] = None  # OpenAI's older name of the above
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    # passed to the template (which may render them); this server parses no tool calls out of the answer
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    documents: Optional[list[dict]] = None
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    add_special_tokens: Optional[bool] = False  # the tokenizer's own (OPT's BOS) on top of what the template writes
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = None  # refused: the server's template is the one that renders
    echo: Optional[bool] = False         # vLLM's (prepend the last message): refused

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if self.chat_template is not None:
            raise InvalidRequest("chat_template: a request cannot bring its own template; this server renders "
                                 "with the one it was started with (--chat-template)", param="chat_template")
        if self.echo:
            raise InvalidRequest("echo is not supported on /v1/chat/completions", param="echo")
        if self.tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice: this server parses no tool calls (only \"none\" is supported; "
                                 "tools are given to the chat template)", param="tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true",
                                 param="continue_final_message")
        self.check_sampling(self.max_completion_tokens or self.max_tokens)
        return self

    @property
    def asked_max_tokens(self) -> Optional[int]:
        """The answer's length limit asked for (None: as long as the context allows)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_asked(self) -> Optional[int]:
        """The generator's `logprobs`: None (none), 0 (the chosen tokens'), or top_logprobs alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_args(self) -> dict:
        """What text.chat.ChatTemplate.prompt_ids takes from the request."""
        return dict(messages=[m.for_template(i) for i, m in enumerate(self.messages)],
                    add_generation_prompt=self.add_generation_prompt is not False,
                    continue_final_message=bool(self.continue_final_message), tools=self.tools,
                    documents=self.documents, template_kwargs=self.chat_template_kwargs,
                    add_special_tokens=bool(self.add_special_tokens))


# ---------------------------------------------------------------- the answer
class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None

    @classmethod
    def of(cls, token: str, logprob: Optional[float]) -> "TokenLogprob":
        # (JSON has no -inf: vLLM writes an impossible token's logprob as -9999.0)
        lp = logprob if logprob is not None and math.isfinite(logprob) else -9999.0
        return cls(token=token, logprob=lp, bytes=list(token.encode("utf-8")))


class ChoiceLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: Optional[list[ChoiceLogprob]] = None

    @classmethod
    def of(cls, d, top: int) -> "ChoiceLogprobs":
        """A generator Delta's (or Completion's) scores in the chat shape: each token with its `top` most likely
        alternatives, best first."""
        content = []
        for token, lp, alternatives in zip(d.tokens, d.token_logprobs, d.top_logprobs):
            items = list((alternatives or {}).items())[:top]
            content.append(ChoiceLogprob(**TokenLogprob.of(token, lp).model_dump(),
                                         top_logprobs=[TokenLogprob.of(t, v) for t, v in items]))
        return cls(content=content)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    token_ids: Optional[list[int]] = omitted_if_none()  # vLLM's return_token_ids: the tokens generated


def _chat_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=_chat_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: Optional[list[Optional[dict[str, PromptLogprob]]]] = omitted_if_none()
    prompt_token_ids: Optional[list[int]] = omitted_if_none()  # vLLM's return_token_ids


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = omitted_if_none()
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    token_ids: Optional[list[int]] = omitted_if_none()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    prompt_token_ids: Optional[list[int]] = omitted_if_none()  # in the first chunk, with return_token_ids
