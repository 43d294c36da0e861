"""The tokenizers of ``sluice make-tiny-model``, trained locally on a fixed synthetic corpus.

Tokenizers come in the two families real models use:

* gpt2 / qwen2 / qwen3 / qwen2_moe / qwen3_moe -- byte-level BPE. gpt2 splits like GPT-2; the
  Qwen ones use exactly the pipeline transformers' ``Qwen2Tokenizer`` builds (see
  ``engine.tokenizer``). Special tokens: ``<|endoftext|>`` 0 (bos = eos, never added by
  encode), ``<|pad|>`` 1, ``<|im_start|>`` 2, ``<|im_end|>`` 3.
* llama / mistral / mixtral -- Llama-2-style SentencePiece BPE with byte fallback: ``<unk>`` 0,
  ``<s>`` 1 (added in front by encode), ``</s>`` 2, ``<pad>`` 3, ``<|im_start|>`` 4,
  ``<|im_end|>`` 5, then ``<0x00>``..``<0xFF>`` (6..261) as ordinary tokens, so
  ``skip_special_tokens`` keeps what they spell. As in Llama-2, text after a special token
  starts with "▁" (a space).

The trained vocabulary has at most MAX_TRAINED_VOCAB tokens; up to the model's vocab_size it is
padded with ordinary filler tokens that decode to " tok<id>" (nothing encodes to them), so
``len(tokenizer) == vocab_size`` and every id a random model emits decodes. The chat template is
ChatML (``<|im_start|>{role}\\n{content}<|im_end|>\\n``; generation prompt
``<|im_start|>assistant\\n``), after ``<s>`` for the llama family.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from services.tiny_corpus import synthetic_corpus

BYTE_FALLBACK_ARCHS = ("llama", "mistral", "mixtral", "phi3", "gemma2", "gemma3_text")

# --- Tokenizer ------------------------------------------------------------------------------------

# What transformers' Qwen2Tokenizer installs, whatever tokenizer.json says (see engine.tokenizer).
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHATML_TEMPLATE = (
    # with tools: a system turn lists them (Hermes / Qwen2.5 style); calls are written as
    # <tool_call>{"name": ..., "arguments": ...}</tool_call>, tool results as a user turn
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions. Their signatures are within "
    "<tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each call, write a JSON object with the function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- if message.tool_calls is defined and message.tool_calls %}"
    "{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}"
    "{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
MAX_TRAINED_VOCAB = 4096  # beyond this, the vocabulary is padded with filler tokens
BYTE_FALLBACK_ALPHABET = 160  # characters of the llama family's alphabet; others use <0x..>


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """The special tokens of one tokenizer family; they take ids 0, 1, ... in ``tokens`` order."""

    byte_fallback: bool
    unk: str | None
    bos: str
    eos: str
    pad: str
    im_start: str = "<|im_start|>"
    im_end: str = "<|im_end|>"

    @classmethod
    def for_arch(cls, arch: str) -> SpecialTokens:
        if arch in BYTE_FALLBACK_ARCHS:
            return cls(byte_fallback=True, unk="<unk>", bos="<s>", eos="</s>", pad="<pad>")
        eot = "<|endoftext|>"
        return cls(byte_fallback=False, unk=None, bos=eot, eos=eot, pad="<|pad|>")

    @property
    def tokens(self) -> list[str]:
        named = (self.unk, self.bos, self.eos, self.pad, self.im_start, self.im_end)
        return list(dict.fromkeys(t for t in named if t is not None))

    def id_of(self, token: str) -> int:
        return self.tokens.index(token)


def build_tokenizer(
    arch: str, vocab_size: int, model_max_length: int = 2048
) -> PreTrainedTokenizerFast:
    """Train the tokenizer of ``arch``'s family and pad it to exactly ``vocab_size`` tokens."""
    special = SpecialTokens.for_arch(arch)
    trained = _train_bpe(arch, min(vocab_size, MAX_TRAINED_VOCAB), special)
    vocab = {token: i for i, token in enumerate(special.tokens)}
    if special.byte_fallback:
        vocab.update({f"<0x{b:02X}>": len(special.tokens) + b for b in range(256)})
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for the {arch} tokenizer")
    _pad_with_fillers(vocab, vocab_size, "\u2581" if special.byte_fallback else "\u0120")
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]],
        unk_token=special.unk,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        byte_fallback=special.byte_fallback,
        fuse_unk=special.byte_fallback,
    )
    backend = _with_pipeline(Tokenizer(bpe), arch)
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special.tokens]
    )
    bos_template = "{{- bos_token }}" if special.byte_fallback else ""
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=special.bos,
        eos_token=special.eos,
        unk_token=special.unk,
        pad_token=special.pad,
        additional_special_tokens=[special.im_start, special.im_end],
        add_bos_token=special.byte_fallback,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        chat_template=bos_template + CHATML_TEMPLATE,
    )


def _train_bpe(arch: str, vocab_size: int, special: SpecialTokens) -> dict[str, Any]:
    """Train BPE on the synthetic corpus; returns the ``model`` part of tokenizer.json."""
    corpus = list(synthetic_corpus())
    if special.byte_fallback:
        alphabet = _frequent_chars(corpus, BYTE_FALLBACK_ALPHABET)
        num_reserved = len(special.tokens) + 256
    else:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        num_reserved = len(special.tokens)
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size - num_reserved, len(alphabet)),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
    )
    tokenizer = _with_pipeline(Tokenizer(models.BPE()), arch)
    tokenizer.train_from_iterator(corpus, trainer)
    return json.loads(tokenizer.to_str())["model"]


def _frequent_chars(corpus: list[str], size: int) -> list[str]:
    """Printable ASCII, ``▁`` and the most frequent other characters (the rest use <0x..>).

    Ties go by code point: the trainer's own ``limit_alphabet`` breaks them in hash order."""
    ascii_chars = [chr(c) for c in range(33, 127)] + ["\u2581"]
    counts = Counter(c for line in corpus for c in line if c not in ascii_chars and c != " ")
    rare_last = sorted(counts, key=lambda c: (-counts[c], c))
    return ascii_chars + rare_last[: max(size - len(ascii_chars), 0)]


def _with_pipeline(tokenizer: Tokenizer, arch: str) -> Tokenizer:
    """Install the normalizer, pre-tokenizer, decoder and post-processor of ``arch``'s family."""
    if arch in BYTE_FALLBACK_ARCHS:
        # Llama-2's tokenizer.json, plus a split at each "▁" (no merge crosses one anyway) so
        # that training and encoding work word by word. SentencePiece's dummy prefix is the
        # normalizer's Prepend: Metaspace's own prepend skips text that starts with a space,
        # and decode (whose Strip drops one leading space) would lose that space.
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=True)
        tokenizer.decoder = decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        return tokenizer
    if arch == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:  # qwen2 / qwen3: the exact pipeline of transformers' Qwen2Tokenizer
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _pad_with_fillers(vocab: dict[str, int], vocab_size: int, space: str) -> None:
    """Add ordinary tokens ``<space>tok<id>`` (no merge produces them) up to ``vocab_size``."""
    while len(vocab) < vocab_size:
        token = f"{space}tok{len(vocab)}"
        while token in vocab:
            token += "_"
        vocab[token] = len(vocab)
