"""Chat messages -> the prompt the model reads, through a Jinja chat template, as Hugging Face and vLLM do it:
transformers' `apply_chat_template` renders the template in jinja2's sandbox (the template sees `messages`,
`add_generation_prompt`, the tokenizer's special tokens such as `bos_token`, and `tools` / `documents` where
given).

The template is the server's `--chat-template` (a file, or the template itself: `load_chat_template`), else the
tokenizer's own (`chat_template` in tokenizer_config.json, or a chat_template.jinja beside it, which transformers
reads when it loads the tokenizer). OPT was not trained for chat and ships none: a chat request to a model without
a template is refused naming `--chat-template`, as vLLM refuses it (transformers no longer supplies a default).

The rendered text is tokenised without the tokenizer's own special tokens unless a request asks (vLLM's
`add_special_tokens`, false for chat): a template writes the BOS it wants (`{{ bos_token }}`).
"""
from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any, Optional, Sequence

from opt_serving.errors import InvalidRequest

NO_TEMPLATE = ("this model has no chat template (its tokenizer defines none), so chat messages cannot be turned "
               "into a prompt: start the server with --chat-template FILE (a Jinja chat template; chat_template in "
               "serve_config.yaml's args), or send a prompt to /v1/completions")


def load_chat_template(value: str) -> str:
    """`--chat-template`'s value as vLLM reads it: the file it names, or, when it names no file but looks like
    Jinja, the template itself. ValueError naming the problem (no such file, a template that does not parse)."""
    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise ValueError(f"--chat-template {value}: no such file (give a Jinja chat template file, or the "
                         "template itself)")
    check_chat_template(text, value if path.is_file() else "--chat-template")
    return text


def check_chat_template(text: str, where: str = "--chat-template") -> None:
    """ValueError where `text` is not a Jinja template transformers can compile (a syntax error, with its line)."""
    import jinja2
    try:
        _compile(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{where}: the chat template does not parse: {e.message} (line {e.lineno})") from None


def _compile(text: str):
    try:  # transformers' own environment (its {% generation %} tag, loop controls), where this version has it
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        import jinja2.sandbox
        return jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]).from_string(text)
    return _compile_jinja_template(text)


class ChatTemplate:
    """A tokenizer and the chat template it renders messages with (`template`, else the tokenizer's own)."""

    def __init__(self, tokenizer, template: Optional[str] = None):
        self.tokenizer = tokenizer
        self.template = template
        if template is not None:
            check_chat_template(template)

    @property
    def available(self) -> bool:
        return self.template is not None or bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: Optional[list] = None,
               documents: Optional[list] = None, template_kwargs: Optional[dict] = None) -> str:
        """The prompt text of a conversation. InvalidRequest: no template (naming --chat-template), template
        variables that would override the renderer's own arguments, or the template refusing the messages (its
        `raise_exception`, a missing field)."""
        import jinja2
        if not self.available:
            raise InvalidRequest(NO_TEMPLATE, param="messages", code="no_chat_template")
        kwargs = dict(template_kwargs or {})
        clash = sorted(set(kwargs) & _renderer_arguments(type(self.tokenizer)))
        if clash:
            raise InvalidRequest(f"chat_template_kwargs: {', '.join(clash)} cannot be set there (an argument of "
                                 "the renderer itself)", param="chat_template_kwargs")
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), chat_template=self.template, tools=tools, documents=documents, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **kwargs)
        except jinja2.TemplateError as e:  # the template's raise_exception(), an undefined field it needed
            raise InvalidRequest(f"messages: the chat template refused them: {e}", param="messages") from None
        except (ValueError, TypeError, KeyError) as e:  # transformers' own checks (continue_final_message, ...)
            raise InvalidRequest(f"messages: {e}", param="messages") from None

    def prompt_ids(self, messages: Sequence[dict], add_special_tokens: bool = False, **render: Any) -> list[int]:
        """The conversation rendered (`render`'s arguments) and tokenised: the ids the model reads."""
        text = self.render(messages, **render)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


@functools.lru_cache(maxsize=8)
def _renderer_arguments(tokenizer_class: type) -> frozenset[str]:
    """apply_chat_template's own parameters: template variables must not reach them through its **kwargs (a
    request's chat_template_kwargs could otherwise swap the template, or ask for tensors)."""
    params = inspect.signature(tokenizer_class.apply_chat_template).parameters
    return frozenset(name for name, p in params.items() if p.kind is not p.VAR_KEYWORD) | {"conversation"}
