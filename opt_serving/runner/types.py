"""What crosses between the engine (scheduler) and the runners (model steps): a request's decoding
settings, the tokens chosen for it, a prefilled request waiting for a slot (or one being prefilled in
chunks), one decode step's result."""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from opt_serving.errors import Unavailable

# top alternatives a token can come with (vLLM's default --max-logprobs); computed only for requests that ask
MAX_TOP_LOGPROBS = 20
PREFILL_MIN_BUCKET = 8  # short prompts (chat turns, benchmarks) are not padded to 16: prefill is compute
# Prompts of a short bucket are prefilled PREFILL_BATCH_TOKENS // bucket at a time: a short prompt alone
# mostly reads the weights, so several share a pass almost for free, and a pass of 32 tokens is already
# close to compute-bound (figures: benchmark/README.md). A prompt alone takes the whole pass, hence the small number.
PREFILL_BATCH_TOKENS = 32
# Short prompts (at most JOIN_PROMPT_TOKENS tokens) can join free slots in the next decode step: their tokens
# ride in the step's products, in a block of the smallest of these sizes that holds them (at most JOIN_PROMPTS
# prompts), where a prefill pass of their own reads every weight again for a handful of tokens. On a CPU a
# step's products are already compute-bound at 32 rows, so a block's padding costs as much as its prompts:
# hence several sizes. Blocks up to 128 tokens: when a batch of streams ends together and their clients send
# the next requests at once, a step takes a dozen or more of them, where before four joined and the rest were
# prefilled two a pass, a pass each ~10 ms with every stream waiting (benchmark/README.md). Not larger: the
# block's attention is one dense [T, T] product per head, most of it masked.
JOIN_BLOCKS, JOIN_PROMPTS, JOIN_PROMPT_TOKENS = (8, 16, 32, 64, 128), 16, 32
# On a GPU a decode step of a model this size is bound by its kernels' launches, not its products: a block of
# JOIN_PROMPTS full prompts costs hardly more than one of four, so a wave of prompts joins in a quarter of the
# steps (benchmark/README.md, "One NVIDIA H200"); and a block may be longer than the context, each of its
# prompts fitting one.
ACCELERATOR_JOIN_BLOCKS = JOIN_BLOCKS + (256, JOIN_PROMPTS * JOIN_PROMPT_TOKENS)
# bad words live in fixed-shape per-slot arrays so the decode step compiles once
MAX_BAD_WORDS, MAX_BAD_WORD_LEN = 8, 8
# and so do logit_bias entries (token id, bias), at most this many a request
MAX_LOGIT_BIAS = 300


@dataclasses.dataclass(frozen=True)
class SlotSettings:
    """One request's decoding settings; the slot model turns them into per-slot arrays."""
    max_tokens: int = 16
    min_tokens: int = 0             # stop tokens are masked out until this many tokens are generated
    temperature: float = 0.0        # 0 = greedy
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0              # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF's: over prompt and generated tokens
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()   # finish "stop" when sampled (EOS); min_tokens holds back the first
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # HF's: a word's last token is banned after its prefix
    no_repeat_ngram_size: int = 0
    prompt_logprobs: bool = False   # score the prompt too (echo with logprobs)
    # the chosen tokens' log-probabilities (TokenInfo.logprob; None when off). A step where no slot wants
    # them and every slot is plainly greedy may then skip the logits (OPTSlots: the screened greedy head)
    logprob: bool = True
    top_logprobs: bool = True       # find each token's top alternatives (a top-k over the vocabulary)
    # OpenAI's logit_bias: (token id, bias) pairs added to the logits before sampling (at most MAX_LOGIT_BIAS)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # structured output: an llguidance grammar (a JSON string, runner/grammar.py) every token must follow; the
    # stage that samples keeps a matcher for the request and masks each step's logits with it
    grammar: Optional[str] = None
    # the LoRA adapter the request runs with, by the name it is served under (runner/lora.py); None: the base model
    lora: Optional[str] = None


@dataclasses.dataclass
class TokenInfo:
    """One token with the model's log-probability (log-softmax of raw logits) and the top alternatives."""
    id: int
    logprob: Optional[float]   # None for a prompt's first token, and when not asked (SlotSettings.logprob)
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # best first
    rank: Optional[int] = None  # a scored prompt token's rank in its distribution (1: the likeliest; vLLM's)


@dataclasses.dataclass
class EngineOutput:
    """What a request's callback receives: prompt scores once, then each new token; the last has finish_reason."""
    tokens: list[TokenInfo]
    is_prompt: bool = False
    finish_reason: Optional[str] = None   # "stop" | "length" | "cancelled" | "error"
    error: Optional[BaseException] = None
    cached_tokens: Optional[int] = None   # on a request's first output: prompt tokens its prefill reused


@dataclasses.dataclass
class Prefix:
    """A prefilled request, ready to be inserted into a slot."""
    length: int                      # prompt tokens
    first: TokenInfo                 # the first generated token (sampled by prefill)
    prompt: Optional[list[TokenInfo]]  # prompt scores when settings.prompt_logprobs
    state: Any                       # the slot model's own (the runner: a handle on the stages' rows)
    settings: SlotSettings
    cached: int = 0                  # prompt tokens whose KV came from the prefix cache, not computed
    tokens: tuple = ()               # the prompt's tokens (speculative decoding drafts from them)


@dataclasses.dataclass
class PartialPrefill:
    """A prompt being prefilled a chunk at a time (`Slots.open_prefill`, `Slots.prefill_chunk`), after the
    prefix its KV came from the prefix cache for."""
    tokens: list[int]
    settings: SlotSettings
    chunk: int                       # tokens a chunk at most (the last is padded to a smaller width: chunk_widths)
    size: int                        # entries of the request's cache (job_size)
    state: Any                       # the slot model's own (the runner: a handle on the stages' rows)
    done: int = 0                    # prompt tokens prefilled so far (the cached ones included)
    cached: int = 0                  # of those, the first ones, whose KV came from the prefix cache
    blocks: list = dataclasses.field(default_factory=list)  # the pool blocks they came from
    keys: list = dataclasses.field(default_factory=list)    # the prompt's full blocks' prefix-cache keys
    scores: list = dataclasses.field(default_factory=list)  # prompt scores of each chunk so far (when asked)


@dataclasses.dataclass
class JoinBlock:
    """Prompts joining free rows of a group in its next decode step (`Slots.join`), as the stages take them:
    a block of T tokens (the prompts one after another, then padding) and, for the sampler, J prompts."""
    ids: np.ndarray          # int32 [T] the tokens
    rows: np.ndarray         # int32 [T] the group row each token's k/v go to (padding: the group's rows, dropped)
    entries: np.ndarray      # int32 [T] its cache entry, which is its position
    seg: np.ndarray          # int32 [T] its prompt (padding: J)
    last: np.ndarray         # int32 [J] each prompt's last token in the block (0 for no prompt)
    last_rows: np.ndarray    # int32 [J] each prompt's row (the group's rows for no prompt)
    prompts: np.ndarray      # int32 [J, W] each prompt, right-padded (pads 0) to W, the longest that may join
    mask: np.ndarray         # int32 [J, W] its real tokens
    lengths: np.ndarray      # int32 [J]
    settings: tuple          # the prompts' SlotSettings
    adapters: Optional[np.ndarray] = None  # int32 [T] each token's LoRA adapter slot (-1: none; None: no adapters)


@dataclasses.dataclass(frozen=True)
class PackedTokens:
    """A ragged step's tokens as one list (runner/packed.py): the rows running first, then the prompts' parts, padded
    to a block size as a whole, so a step's products run at the tokens it has, not at every row of the group."""
    src: np.ndarray          # int32 [N] the group row whose newest token this is (-1: a prompt token, or padding)
    ids: np.ndarray          # int32 [N] a prompt token (0 elsewhere)
    rows: np.ndarray         # int32 [N] the group row its k/v go to (padding: the group's rows, dropped)
    entries: np.ndarray      # int32 [N] its cache entry, which is its position
    # int32 [rows] each row's token whose hidden state the sampler takes; a row without one takes token 0's, its
    # choice discarded (zeros defeat the greedy head's screen, which then computes every logit of the row)
    out: np.ndarray
    adapters: Optional[np.ndarray] = None  # int32 [N] each token's LoRA adapter slot (-1: none; None: no adapters)
    # speculative decoding (runner/ngram.py; None: no row drafts): the drafts ride after the running rows' tokens
    verify: Optional[np.ndarray] = None     # int32 [E] the drafts' tokens in the list (-1: padding)
    draft_ids: Optional[np.ndarray] = None  # int32 [rows, K] each row's drafts, in order (-1: none)
    draft_at: Optional[np.ndarray] = None   # int32 [rows, K] where in `verify` each is (-1: none)


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """One decode step of a group, as the driver hands it whole to every stage and the last stage's sampler
    (`Slots._decode_step`); what differs from stage to stage, the tokens or hidden states going in, is passed
    beside it. A row of the group is slot row * groups + group."""
    group: int
    positions: np.ndarray          # int32 [rows] each row's newest token's position (-1: a row not stepped)
    window: int                    # the entries the group's cache is fitted to first (a cache window)
    read_len: int                  # the entries a row reads at most (the longest row's tokens)
    want_scores: bool              # does a row want its token's log-probability (or its top alternatives)
    want_top: bool                 # does a row want its token's top alternatives
    join: Optional[JoinBlock] = None        # prompts joining free rows of the group in this step
    adapters: Optional[np.ndarray] = None   # int32 [rows] each row's LoRA adapter slot (-1: none)
    steps: int = 1                 # steps taken in one call (StageSlots.decode_steps), each fed the last's tokens
    packed: Optional[PackedTokens] = None   # the step's tokens as one list (ragged stages), `join` the sampler's view
    rows: Optional[np.ndarray] = None      # int32 [R] the rows `steps` compute, padded with len(positions); None: all


def acceptance_length(accepted: float, drafts: float) -> float:
    """Speculative decoding's mean acceptance length (vLLM's): the tokens a drafting row's step, or a speculative
    round, gave on average, 1 + accepted / drafts; 0 before any draft."""
    return 1 + accepted / drafts if drafts else 0.0


@dataclasses.dataclass
class StepResult:
    """One decode step over the slots (rows of inactive slots are garbage). A pipelined runner steps one
    micro-batch group at a time: `rows` marks the slots this step produced a token for (None: all)."""
    tokens: np.ndarray        # int32 [slots]
    logprobs: np.ndarray      # float32 [slots]
    top_ids: np.ndarray       # int32 [slots, MAX_TOP_LOGPROBS]
    top_logprobs: np.ndarray  # float32 [slots, MAX_TOP_LOGPROBS]
    rows: Optional[np.ndarray] = None  # bool [slots]
    # speculative decoding (runner/ngram.py): each slot's tokens past `tokens[slot]` its accepted drafts gave (a
    # slot not drafting: none), and the step's counts: rows that drafted, tokens drafted, drafts accepted
    more: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    # the arrays as Python values, made at the first token() (a step's tokens are handed out one slot at a time,
    # and numpy's scalars, element by element, were most of a token's hand-out)
    _host: Optional[tuple] = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def token(self, slot: int, logprob: bool = True) -> TokenInfo:
        """The slot's token, with its log-probability (None unless `logprob`) and the top alternatives the step
        found for it (none where it was not asked for them)."""
        if self._host is None:
            self._host = (self.tokens.tolist(), self.logprobs.tolist(), (self.top_ids >= 0).any(axis=1).tolist())
        tokens, logprobs, has_top = self._host
        top = []
        if has_top[slot]:
            top = [(i, lp) for i, lp in zip(self.top_ids[slot].tolist(), self.top_logprobs[slot].tolist()) if i >= 0]
        return TokenInfo(tokens[slot], logprobs[slot] if logprob else None, top)

    def tokens_of(self, slot: int, logprob: bool = True) -> list[TokenInfo]:
        """The slot's tokens from this step: `token`'s, then those its accepted drafts gave (never scored: a
        drafting row asks for no scores)."""
        return [self.token(slot, logprob)] + [TokenInfo(t, None, []) for t in self.more.get(slot, ())]


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """What a token costs the model, to read a step's time against the machine's bounds: FLOPs of its dense
    layers (2 a weight), of the LM head where it is applied (a prompt's last token, every decoded one), the bytes
    of weights a pass reads once, and the bytes of one KV entry (every layer's k and v)."""
    dense_flops: float
    head_flops: float
    weight_bytes: float
    kv_entry_bytes: float

    @classmethod
    def of(cls, cfg, weights: str = "float32", cache_width: int = 4) -> "ModelCosts":
        """`weights`: the dense layers' format (float32, float16, bfloat16, int8); `cache_width`: bytes of a KV
        number."""
        d, f, n, v = cfg.hidden_size, cfg.ffn_dim, cfg.num_hidden_layers, cfg.vocab_size
        dense = n * (4 * d * d + 2 * d * f)
        head = v * cfg.word_embed_proj_dim
        width = {"int8": 1, "bfloat16": 2, "float16": 2}.get(weights, 4)
        return cls(2.0 * dense, 2.0 * head, float((dense + head) * width), 2.0 * n * d * cache_width)


class StageDied(Unavailable):
    """A pipeline stage (a Ray actor) is gone: the model cannot serve until it is loaded again."""
    code = "stage_died"


# The stage interface: every call a runner makes on a stage (Slots through Stages.call), and whether it is a step
# of the model (a stage actor counts those as busy time). StageSlots implements each; a Ray stage actor
# (parallel/pipeline.py) is generated from this table, so the two cannot drift apart.
STAGE_CALLS = {"prefill": True, "prefill_chunk": True, "decode": True, "decode_steps": True,
               "send_steps": True, "take_steps": False,  # decode_steps sent and read back apart (Slots.send_many)
               "insert": False, "store_prefix": False, "use_prefix": False, "store_row": False, "drop": False,
               "free": False, "use_tokenizer": False, "is_ragged": False,
               "begin_warmup": False, "end_warmup": False, "abandon_warmup": False, "cache_windows": False,
               "platform": False, "ready": False,
               "set_lora": False, "lora_layout": False,  # LoRA adapters (runner/lora.py)
               # whole-sequence caches: generate() over a pipeline (runner/generate.py)
               "seq_open": False, "seq_prefill": True, "seq_decode": True, "seq_reorder": False, "seq_close": False,
               # speculative decoding's check of drafted tokens (runner/speculative.py)
               "seq_extend": True, "seq_continue": True,
               # a whole generate() in one compiled loop, on a stage that is the whole model (never an actor's)
               "seq_generate": True, "seq_beam_search": True}


class SlotModel(abc.ABC):
    """What the engine drives: `num_slots` decode slots over one model (runner.slots.Slots; the fake engine's
    FakeSlots). The five abstract methods are what every slot model has. What only some have is declared by
    the class attributes below, which the engine and admission read (never probing for methods); the methods
    of an ability a model does not declare raise NotImplementedError, and the rest default to doing nothing."""
    num_slots: int
    max_seq_len: int
    vocab_size: int
    max_top_logprobs: int = MAX_TOP_LOGPROBS  # the most top alternatives a token can come with
    costs: Optional[ModelCosts] = None  # what a token costs the model (None: not known, e.g. a fake model)

    # abilities
    batched_prefill: bool = False  # prefill_batch: several requests' prompts in one pass
    chunked_prefill: bool = False  # open_prefill / prefill_chunk / discard_partial: a prompt a chunk at a time
    joins_steps: bool = False      # joinable / join: a short prompt prefilled inside the next decode step
    many_steps: bool = False       # step_many: n decode steps in one call, each fed the last one's tokens
    sends_ahead: bool = False      # send_many / take_many: such a call sent before the one in flight is read
    joins_in_parts: bool = False   # join takes any prompt, its tokens riding several steps (chunked prefill)
    masks_tokens: bool = False     # use_tokenizer: structured output's token masks
    runs_generate: bool = False    # generation_model: a model beam search runs generate() on
    calls_in_flight: int = 0  # calls sent ahead (send_many) and not yet taken
    loras = None  # the LoRA adapters served (runner.lora.Adapters; SlotSettings.lora names one), or None

    @abc.abstractmethod
    def warmup(self, prefill_chunk: Optional[int] = None, decode_steps: int = 1, every_shape: bool = True) -> None:
        """Compile now what serving runs, not at the first request (without `every_shape`: what generation runs,
        where the slot model tells that apart; the rest at its first use)."""

    @abc.abstractmethod
    def prefill(self, tokens: Sequence[int], settings: SlotSettings) -> Prefix:
        """A prompt's prefill, not yet in a slot."""

    @abc.abstractmethod
    def insert(self, prefix: Prefix, slot: int) -> None:
        """A prefilled prompt into a free slot: its first token was given, it decodes from the next step."""

    @abc.abstractmethod
    def step(self) -> StepResult:
        """One decode step of every occupied slot."""

    @abc.abstractmethod
    def free(self, slot: int) -> None:
        """A slot's request is done: the slot takes the next."""

    def prompt_cost(self, tokens: Sequence[int], settings: SlotSettings) -> int:
        """The prompt tokens a prefill would compute now: a prefix cache's model computes only those past its
        cached prefix (Prefix.cached says how many it reused)."""
        return len(tokens)

    def discard(self, prefix: Prefix) -> None:
        """A prefix that will never be inserted: its rows are let go."""

    def check_health(self) -> None:
        """Raise when the model cannot serve (a pipeline's stage died)."""

    def close(self) -> None:
        """Free what the model holds beyond this process (a pipeline's stage actors and placement group)."""

    def prefill_batch(self, prompts: Sequence[Sequence[int]], settings: Sequence[SlotSettings]) -> list[Prefix]:
        raise NotImplementedError(f"{type(self).__name__} has no batched_prefill")

    def open_prefill(self, tokens: Sequence[int], settings: SlotSettings, chunk: int, size: Optional[int] = None):
        raise NotImplementedError(f"{type(self).__name__} has no chunked_prefill")

    def prefill_chunk(self, job) -> Optional[Prefix]:
        raise NotImplementedError(f"{type(self).__name__} has no chunked_prefill")

    def discard_partial(self, job) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no chunked_prefill")

    def joinable(self, tokens: Sequence[int], settings: SlotSettings) -> bool:
        raise NotImplementedError(f"{type(self).__name__} does not join steps")

    def join(self, tokens: Sequence[int], settings: SlotSettings, slot: int) -> bool:
        """The prompt takes the slot, its prefill in the next decode steps (False: it does not join)."""
        raise NotImplementedError(f"{type(self).__name__} does not join steps")

    def cached_of(self, slot: int) -> int:
        """The prompt tokens the prefix cache gave the prompt that joined the slot (known by its first token)."""
        return 0

    def set_prefill_chunk(self, chunk: Optional[int]) -> None:
        """The engine's prefill chunk (a model whose joined prompts go a part at a time takes that many a step)."""

    def step_many(self, n: int) -> list[StepResult]:
        raise NotImplementedError(f"{type(self).__name__} has no many_steps")

    def send_many(self, n: int):
        """Send a call of `step_many` after the ones in flight, not waiting for it (None: not sent, as step_many
        would take one step); only `free` may come between it and its `take_many`."""
        raise NotImplementedError(f"{type(self).__name__} does not send ahead")

    def take_many(self) -> list[StepResult]:
        """The oldest sent call's results, one a step."""
        raise NotImplementedError(f"{type(self).__name__} does not send ahead")

    def abandon_many(self) -> None:
        """Forget the calls in flight (a step failed: their requests fail with it)."""

    def use_tokenizer(self, tokenizer_json: str, eos: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot mask tokens")

    def generation_model(self):
        raise NotImplementedError(f"{type(self).__name__} has no model to run generate() on")
