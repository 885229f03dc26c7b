"""One frozen config for every OPT size, with named presets.

Field names follow Hugging Face's `OPTConfig` so a `config.json` round-trips
between the two; `from_hf_json` / `to_hf_dict` do the translation.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class OPTConfig:
    vocab_size: int = 50272
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    ffn_dim: int = 3072
    max_position_embeddings: int = 2048
    # OPT-350m embeds into 512 and projects in/out of the 1024-wide decoder.
    word_embed_proj_dim: int = 768
    # Pre-LayerNorm (every size but 350m); post-LN models have no final layer norm.
    do_layer_norm_before: bool = True
    activation_function: str = "relu"
    layer_norm_elementwise_affine: bool = True
    enable_bias: bool = True
    pad_token_id: int = 1
    bos_token_id: int = 2
    eos_token_id: int = 2
    # learned positions are stored with fairseq's offset of 2 extra rows
    position_offset: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def has_project_in_out(self) -> bool:
        return self.word_embed_proj_dim != self.hidden_size

    @property
    def has_final_layer_norm(self) -> bool:
        # HF OPT: final layer norm exists only for pre-LN models (350m has none)
        return self.do_layer_norm_before

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}")
        if self.activation_function != "relu":
            raise ValueError(f"only relu OPT models are supported, got {self.activation_function!r}")

    def num_params(self) -> int:
        """Parameter count: the tensors of the numpy folder (model/weights.py `param_shapes`),
        counted here from the fields because config imports nothing of ours (it is the bottom
        layer); tests/test_config.py checks the two agree for every preset."""
        h, f, e = self.hidden_size, self.ffn_dim, self.word_embed_proj_dim
        # q, k, v, out_proj [h, h] + bias; fc1 [f, h] + bias; fc2 [h, f] + bias; two layer norms
        per_layer = 4 * (h * h + h) + (f * h + f) + (h * f + h) + 2 * 2 * h
        total = self.num_hidden_layers * per_layer
        total += self.vocab_size * e                                     # embed_tokens
        total += (self.max_position_embeddings + self.position_offset) * h  # embed_positions
        if self.has_final_layer_norm:
            total += 2 * h
        if self.has_project_in_out:
            total += 2 * h * e                                           # project_in / project_out
        return total

    def replace(self, **changes: Any) -> "OPTConfig":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json ----
    _HF_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "ffn_dim", "max_position_embeddings", "word_embed_proj_dim",
                  "do_layer_norm_before", "activation_function",
                  "layer_norm_elementwise_affine", "enable_bias", "pad_token_id",
                  "bos_token_id", "eos_token_id")

    def to_hf_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self._HF_FIELDS}
        d.update(model_type="opt", architectures=["OPTForCausalLM"], dropout=0.0,
                 attention_dropout=0.0, layerdrop=0.0, init_std=0.02,
                 use_cache=True, torch_dtype="float32")
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "OPTConfig":
        kwargs = {k: d[k] for k in cls._HF_FIELDS if k in d and d[k] is not None}
        if "word_embed_proj_dim" not in kwargs:
            kwargs["word_embed_proj_dim"] = kwargs.get("hidden_size", cls.hidden_size)
        if "hidden_size" in kwargs and "ffn_dim" not in kwargs:
            kwargs["ffn_dim"] = 4 * kwargs["hidden_size"]
        return cls(**kwargs)

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "OPTConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(data)

    def save_hf_json(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")


def _opt(hidden, layers, heads, **kw) -> OPTConfig:
    return OPTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     ffn_dim=4 * hidden, word_embed_proj_dim=kw.pop("word_embed_proj_dim", hidden),
                     **kw)


# The embedded default model: small enough to build in a second, big enough to
# exercise every code path (several layers and heads).
TINY_VOCAB_SIZE = 1024

OPT_CONFIGS: dict[str, OPTConfig] = {
    "tiny": _opt(128, 4, 4, vocab_size=TINY_VOCAB_SIZE, max_position_embeddings=512),
    "125m": _opt(768, 12, 12),
    "350m": _opt(1024, 24, 16, word_embed_proj_dim=512, do_layer_norm_before=False),
    "1.3b": _opt(2048, 24, 32),
    "2.7b": _opt(2560, 32, 32),
    "6.7b": _opt(4096, 32, 32),
    "13b": _opt(5120, 40, 40),
    "30b": _opt(7168, 48, 56),
    "66b": _opt(9216, 64, 72),
    "175b": _opt(12288, 96, 96),
}
# OPT-IML (instruction-tuned OPT, facebook/opt-iml-*): the same architectures as the OPT sizes they were tuned from
OPT_CONFIGS.update({f"iml-{kind}{size}": OPT_CONFIGS[size]
                    for kind in ("", "max-") for size in ("1.3b", "30b")})


def size_from_name(model_name: str) -> str:
    """'alpa/opt-2.7b' -> '2.7b'; 'opt-tiny' -> 'tiny'; 'facebook/opt-iml-max-30b' -> 'iml-max-30b'."""
    base = model_name.rsplit("/", 1)[-1].lower()
    if base.startswith("opt-"):
        base = base[len("opt-"):]
    if base not in OPT_CONFIGS:
        known = ", ".join(f"opt-{k}" for k in OPT_CONFIGS)
        raise ValueError(f"unknown OPT model {model_name!r}; known sizes: {known}")
    return base


def get_config(name: str) -> OPTConfig:
    return OPT_CONFIGS[size_from_name(name)]


def config_for(name: str, folder: str | Path | None = None) -> OPTConfig:
    """A model's config: the folder's config.json when it has one (any name then works, it is only a label:
    "jax/my-finetune"), else the preset the name gives (ValueError naming the known ones)."""
    if folder is not None and (Path(folder) / "config.json").is_file():
        return OPTConfig.from_hf_json(Path(folder) / "config.json")
    return get_config(name)


# the most tokens a served row drafts a step (each is one more token in the step's products)
MAX_SPECULATIVE_TOKENS = 8
# the chunks a draft model's row cache is fed in (runner/draft.py: each a compile of the draft model)
DRAFT_WIDTHS = (1, 2, 8, 64)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Served speculative decoding, as vLLM's `--speculative-config` spells it: prompt lookup ("ngram": the tokens
    that followed the latest earlier occurrence of a row's last n tokens, n from `prompt_lookup_max` down to
    `prompt_lookup_min`), or a draft model ("draft_model": `model`, a jax/ or facebook/ name with its numpy
    weights folder `path`, or the embedded "opt-tiny" without one), the target's vocabulary, on one device."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    model: Optional[str] = None
    path: Optional[str] = None

    @property
    def draft_cache_extra(self) -> int:
        """Entries a draft model's row cache holds past the row's tokens: the widest chunk fed and the drafts."""
        return DRAFT_WIDTHS[-1] + self.num_speculative_tokens

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A JSON object (a string, as on the command line) or a dict (serve_config.yaml) -> the config; None or an
        empty value -> None (no speculation). ValueError naming what is wrong."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        if not value:
            return None
        value = {k: v for k, v in value.items() if not (k in ("model", "path") and v is None)}
        method = _speculative_method(value)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            if key in value and (not isinstance(value[key], int) or isinstance(value[key], bool)):
                raise ValueError(f"speculative_config: {key} must be an integer, got {value[key]!r}")
        for key in ("model", "path"):
            if key in value and not isinstance(value[key], str):
                raise ValueError(f"speculative_config: {key} must be a string, got {value[key]!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        config = cls(method=method, **value)
        if not 1 <= config.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be 1 to {MAX_SPECULATIVE_TOKENS}, "
                             f"got {config.num_speculative_tokens}")
        if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{config.prompt_lookup_min} and {config.prompt_lookup_max}")
        return config

    def as_dict(self) -> dict:
        """The keys its method reads, spelt out (what the command line hands a replica; parse takes it back)."""
        keys = (("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min") if self.model is None
                else ("method", "num_speculative_tokens", "model", "path"))
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


def _speculative_method(value: dict) -> str:
    """The method a speculative_config asks for ("ngram" or "draft_model", from `method` or the `model` key;
    popped from `value`), its keys checked against it."""
    method = value.pop("method", None)
    if method not in (None, "ngram", "draft_model"):
        raise ValueError(f"speculative_config: unknown method {method!r} (served: 'ngram', prompt lookup, and "
                         "'draft_model', a draft model named by 'model')")
    if "model" not in value:
        if method == "draft_model":
            raise ValueError("speculative_config: method 'draft_model' needs 'model', the draft model's name "
                             "(e.g. \"jax/opt-125m\" with its weights folder in 'path', or \"opt-tiny\")")
        if "path" in value:
            raise ValueError("speculative_config: 'path' is the draft model's weights folder; give 'model' too")
        return "ngram"
    if method == "ngram":
        raise ValueError("speculative_config: method 'ngram' (prompt lookup) takes no 'model'")
    lookup = sorted(k for k in ("prompt_lookup_max", "prompt_lookup_min") if k in value)
    if lookup:
        raise ValueError(f"speculative_config: {', '.join(lookup)}: prompt lookup's (method 'ngram'), not a draft "
                         "model's")
    return "draft_model"
