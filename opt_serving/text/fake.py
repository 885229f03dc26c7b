"""The fake engine at the text level (engine/fake.py has its rules): a byte-level tokenizer whose ids the fake
model's outputs are worked out in, and a `Generator` over the fake engine (`opt-serving serve --engine fake`)."""
from __future__ import annotations

from opt_serving.engine.fake import BYTE_OFFSET, FakeBeamModel, fake_engine
from opt_serving.text.generator import Generator


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells " " as "\u0120")."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer():
    """A transformers tokenizer over single bytes (byte-level BPE, no merges), OPT's specials and leading </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    b2u = _bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({b2u[b]: BYTE_OFFSET + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(specials)  # skipped when decoding text, like OPT's
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


def fake_generator(num_slots: int = 4, max_seq_len: int = 64, max_queue: int = 16, start: bool = True,
                   tokenizer=None, decode_steps: int = 1, step_s: float = 0.0):
    """A `Generator` over the fake engine: the byte tokenizer by default, or any tokenizer (the fake's
    vocabulary then follows it, e.g. the real OPT one). `step_s`: how long each decode step takes."""
    tokenizer = tokenizer if tokenizer is not None else byte_tokenizer()
    engine = fake_engine(num_slots, max_seq_len, max_queue, start, vocab_size=len(tokenizer),
                         decode_steps=decode_steps, step_s=step_s)
    return Generator(engine, tokenizer, model_name="opt-fake", model=FakeBeamModel(len(tokenizer)))
