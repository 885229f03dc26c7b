"""Structured output: what a request asks its text to follow, as an llguidance grammar, checked before it is queued.

`StructuredOutput` is the one form every front end maps its fields onto (the HTTP routes: OpenAI's
`response_format`, vLLM's `structured_outputs` and its older `guided_*` fields): a JSON schema, any JSON object, a
regular expression, one of a list of strings, or a grammar (Lark, or llama.cpp's GBNF as vLLM takes it).
`grammar_of` turns it into an llguidance grammar and `check_grammar` has llguidance build it against the tokenizer,
so a schema it cannot follow is an InvalidRequest naming the problem (a 400), never a failed generation. The stage
that samples keeps a matcher per request and masks every step with it (runner/grammar.py).

JSON is written without free whitespace by default: JSON allows any amount between its tokens, and a model that
favours it (vLLM's output on random weights was `{` and then whitespace until max_tokens) never finishes; here
objects come out compact (`{"a":1,"b":[2,3]}`), so a small object ends within a few dozen tokens. A request may
ask for its own `whitespace_pattern` (vLLM's field).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Literal, Optional

from opt_serving.errors import InvalidRequest

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
MAX_SPEC_CHARS = 1 << 20  # a schema, regex, grammar or list of choices, as JSON


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What a completion's text must follow. `spec`: the JSON schema as JSON text (json), the regex, the choices as
    a JSON list, or the grammar text. `param`: the request field it came from (named by errors)."""
    kind: Kind
    spec: str = ""
    whitespace_pattern: Optional[str] = None
    disable_additional_properties: bool = False
    param: str = "structured_outputs"

    @classmethod
    def of(cls, kind: Kind, value: Any, param: str, **options) -> "StructuredOutput":
        """From a request's field: a schema may come as an object or as JSON text, choices as a list of strings."""
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise InvalidRequest(f"{param}: the JSON schema is not valid JSON: {e}", param=param) from None
            if not isinstance(value, (dict, bool)):
                raise InvalidRequest(f"{param}: a JSON schema must be an object, got {value!r:.60}", param=param)
            spec = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
                raise InvalidRequest(f"{param}: choice must be a non-empty list of non-empty strings, got "
                                     f"{value!r:.60}", param=param)
            spec = json.dumps(value)
        elif kind in ("regex", "grammar"):
            if not (isinstance(value, str) and value):
                raise InvalidRequest(f"{param}: {kind} must be a non-empty string", param=param)
            spec = value
        else:
            spec = ""
        if len(spec) > MAX_SPEC_CHARS:
            raise InvalidRequest(f"{param}: the {kind} constraint is longer than {MAX_SPEC_CHARS} characters",
                                 param=param)
        return cls(kind, spec, param=param, **options)


def _no_additional_properties(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema that does not say otherwise allows no other
    properties."""
    if isinstance(schema, dict):
        schema = {k: _no_additional_properties(v) for k, v in schema.items()}
        if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_no_additional_properties(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=256)
def grammar_of(so: StructuredOutput) -> str:
    """The llguidance grammar (JSON text) of a structured-output request. InvalidRequest where it cannot be one."""
    import llguidance
    from llguidance import LLMatcher
    # compact JSON unless asked otherwise: no free whitespace (see the module docstring)
    options = {"whitespace_flexible": False} if so.whitespace_pattern is None else {
        "whitespace_flexible": True, "whitespace_pattern": so.whitespace_pattern}
    try:
        if so.kind in ("json", "json_object"):
            schema = json.loads(so.spec) if so.kind == "json" else {"type": "object"}
            if so.disable_additional_properties:
                schema = _no_additional_properties(schema)
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        return llguidance.grammar_from(so.kind, so.spec)  # regex, choice, grammar (Lark or GBNF)
    except ValueError as e:
        raise InvalidRequest(f"{so.param}: {e}", param=so.param) from None


@functools.lru_cache(maxsize=256)
def _problem(grammar: str, tokenizer) -> str:
    from llguidance import LLMatcher
    return LLMatcher.validate_grammar(grammar, tokenizer)


def check_grammar(so: StructuredOutput, tokenizer) -> str:
    """The grammar of `so`, built by llguidance against `tokenizer` (runner.grammar.ll_tokenizer) -> the grammar;
    InvalidRequest naming what llguidance could not follow (an unknown type, an unsupported keyword, a bad
    regex...)."""
    grammar = grammar_of(so)
    try:
        problem = _problem(grammar, tokenizer)
    except Exception as e:  # (llguidance reports problems in its answer; anything it raises is one too)
        problem = f"{type(e).__name__}: {e}"
    if problem:
        # one line: llguidance's own lines, less those that only point a caret at the line above
        problem = " ".join(line.strip() for line in problem.splitlines() if line.strip().strip("^"))
        raise InvalidRequest(f"{so.param}: cannot follow this {so.kind.replace('_', ' ')} constraint: {problem}",
                             param=so.param, code="invalid_grammar")
    return grammar
