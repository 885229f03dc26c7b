"""A model's requests checked and tokenised before anything reaches its engine: `Checker`, the half of `Generator`
(generator.py) that runs on the caller's thread and needs no stream.

`Checker.prepare` runs request.py's checks in one order for every caller (the HTTP routes, the batch runner,
library callers) and tokenises the prompt: the ids a stream then takes. Beside it, the tokenizer's other uses
(vLLM's /tokenize and /detokenize, the text a token id stands for), the LoRA adapters a request may name (and
loading or unloading them) and the structured-output grammars' view of the tokenizer, made at their first request.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Optional, Sequence, Union

from opt_serving.engine.scheduler import MAX_TOP_LOGPROBS, Engine
from opt_serving.errors import InvalidRequest, NotFound
from opt_serving.model.peft import AdapterError
from opt_serving.runner.grammar import ll_tokenizer, tokenizer_json
from opt_serving.text.request import (ModelLimits, Prompt, SamplingParams, check_for_model, check_prompt,
                                      prompt_form, refuse_surely_too_long, truncate_prompt)
from opt_serving.text.structured import StructuredOutput, check_grammar
from opt_serving.text.token_text import TokenTexts


class Checker:
    """Requests for the model an engine (`engine.Engine` or the fake one) serves, checked and tokenised with its
    tokenizer."""

    def __init__(self, engine: Engine, tokenizer, max_seq_len: Optional[int] = None, model_name: str = "opt"):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_seq_len = min(max_seq_len or engine.max_seq_len, engine.max_seq_len)
        self.model_name = model_name
        self.eos_token_id = tokenizer.eos_token_id
        self.token_text = TokenTexts(tokenizer)  # token id -> its own text, as logprobs show it
        self._grammar_lock = threading.Lock()
        self._ll_tokenizer = None  # structured output's view of the tokenizer, made at the first such request

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_top_logprobs(self) -> int:
        return getattr(self.engine, "max_top_logprobs", MAX_TOP_LOGPROBS)

    @functools.cached_property
    def limits(self) -> ModelLimits:
        """What requests are checked against (request.check_for_model)."""
        return ModelLimits(self.vocab_size, self.max_seq_len, self.max_top_logprobs, self.eos_token_id)

    # ---- tokens ----
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(list(texts))["input_ids"]] if texts else []

    def encode(self, text: str) -> list[int]:
        """Text -> ids, with OPT's leading </s> (the tokenizer's add_bos_token)."""
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """vLLM's /tokenize: text -> ids (OPT's leading </s> with `add_special_tokens`)."""
        if not isinstance(text, str):
            raise InvalidRequest(f"prompt must be a string, got {text!r:.60}", param="prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def detokenize(self, ids: Sequence[int]) -> str:
        """vLLM's /detokenize: ids of this model's vocabulary -> their text, special tokens written as they are
        spelled ("</s>Hello"), as vLLM decodes them."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"tokens: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                 param="tokens")
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @functools.cached_property
    def max_token_chars(self) -> Optional[int]:
        """The most characters one token can stand for (its bytes, in byte-level BPE); None if unknown."""
        texts, most = self.token_text, 1
        for i in range(len(self.tokenizer)):
            data = texts.token_bytes(i)
            if data is None and not texts.is_special(i):
                return None  # not byte-level: no bound known
            most = max(most, len(data) if data is not None else len(texts(i)))
        return most

    def _added_tokens(self, prompt: Prompt, ids: list[int]) -> int:
        """How many leading ids the tokenizer added to a text prompt (OPT's BOS); 0 for token-id prompts."""
        if not isinstance(prompt, str):
            return 0
        plain = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        k = len(ids) - len(plain)
        return k if k > 0 and ids[k:] == plain else 0

    # ---- checking (request.py's checks, in one order for every caller) ----
    def prepare(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Check and tokenise a request (blocking; any thread, so a server can keep it off its event loop):
        the ids `Generator.stream(..., ids=)` takes. Raises InvalidRequest (a ValueError) naming the field at fault;
        ContextLengthExceeded when the prompt and max_tokens do not fit."""
        screened = self._screen(prompt, params)
        ids = self.encode(screened) if isinstance(screened, str) else screened
        return self._fit(ids, params)

    def _fit(self, ids: list[int], params: SamplingParams) -> list[int]:
        """A tokenised prompt truncated as asked (truncate_prompt_tokens) and checked against the model."""
        ids = truncate_prompt(ids, params, self.max_seq_len)
        check_prompt(ids, params.max_tokens, self.vocab_size, self.max_seq_len)
        return ids

    def prepare_many(self, prompts: Sequence[Prompt], params: Sequence[SamplingParams]
                     ) -> list[Union[list[int], InvalidRequest]]:
        """`prepare()` for many requests, the texts tokenised in one tokenizer call (the batch runner): each
        request's ids, or the InvalidRequest it raises, in its place."""
        screened: list[Any] = []
        for prompt, p in zip(prompts, params):
            try:
                screened.append(self._screen(prompt, p))
            except InvalidRequest as e:
                screened.append(e)
        encoded = iter(self.encode_batch([s for s in screened if isinstance(s, str)]))
        out: list[Union[list[int], InvalidRequest]] = []
        for s, p in zip(screened, params):
            if not isinstance(s, InvalidRequest):
                s = next(encoded) if isinstance(s, str) else s
                try:
                    s = self._fit(s, p)
                except InvalidRequest as e:
                    s = e
            out.append(s)
        return out

    def _screen(self, prompt: Prompt, params: SamplingParams) -> Union[str, list[int]]:
        """Every check that needs no tokenising; the prompt as text or as a list of ids."""
        params.validate()
        check_for_model(params, self.limits)
        self.check_lora(params.lora)
        if params.structured is not None:
            check_grammar(params.structured, self.grammar_tokenizer(params.structured))
        prompt = prompt_form(prompt)
        if isinstance(prompt, str) and params.truncate_prompt_tokens is None:  # (truncated: any length fits)
            refuse_surely_too_long(prompt, params.max_tokens, self.max_seq_len, self.max_token_chars)
        return prompt

    # ---- LoRA adapters (the engine's slot model serves them: runner/lora.py) ----
    def lora_names(self) -> list[str]:
        """The LoRA adapters served, by name (none where the model serves none)."""
        loras = self.engine.model.loras
        return [] if loras is None else loras.names()

    def check_lora(self, name: Optional[str]) -> None:
        """NotFound (404) for an adapter this model does not serve."""
        if name is not None and name not in self.lora_names():
            raise NotFound(f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def lora_path(self, name: str) -> Optional[str]:
        adapter = None if self.engine.model.loras is None else self.engine.model.loras.adapter(name)
        return None if adapter is None else adapter.path

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (blocking: it is read and converted in this thread, off the
        engine's; its first request puts it on the device, between two steps). InvalidRequest where the model
        serves no adapters, the name is taken or the adapter does not fit (model.peft.AdapterError's message)."""
        if self.engine.model.loras is None:
            raise InvalidRequest(f"{self.model_name} serves no LoRA adapters (start it with --enable-lora)",
                                 param="lora_name")
        if name == self.model_name:
            raise InvalidRequest(f"'{name}' is the base model's name", param="lora_name")
        try:
            self.engine.model.loras.add(name, path)
        except AdapterError as e:  # the file or its fit, named: the request's lora_path is at fault
            raise InvalidRequest(str(e), param="lora_path") from None

    def unload_lora(self, name: str) -> None:
        """Serve `name` no more (NotFound if it is not served); its running requests finish with it."""
        if self.engine.model.loras is None:
            raise NotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name")
        self.engine.model.loras.remove(name)

    def grammar_tokenizer(self, so: StructuredOutput):
        """llguidance's view of the tokenizer (runner.grammar.ll_tokenizer), made at the first structured-output
        request and handed to the stage that samples; InvalidRequest where the engine has no such stage."""
        with self._grammar_lock:
            if self._ll_tokenizer is None:
                if not self.engine.model.masks_tokens:
                    raise InvalidRequest(f"structured output is not available with {self.model_name}: its engine "
                                         "cannot mask its tokens", param=so.param)
                text = tokenizer_json(self.tokenizer)
                tok = ll_tokenizer(text, self.vocab_size, self.eos_token_id)
                self.engine.model.use_tokenizer(text, self.eos_token_id)
                self._ll_tokenizer = tok
            return self._ll_tokenizer
