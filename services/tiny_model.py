"""``sluice make-tiny-model``: small random models with a locally trained tokenizer.

Nothing can be downloaded, so tests and benchmarks use random weights saved as real Hugging Face
folders (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json, chat_template.jinja) that transformers and sluice both load.

Tokenizers come in the two families real models use, trained on a fixed synthetic corpus:

* gpt2 / qwen2 / qwen3 -- byte-level BPE. gpt2 splits like GPT-2; qwen2 / qwen3 use exactly the
  pipeline transformers' ``Qwen2Tokenizer`` builds (see ``engine.tokenizer``). Special tokens:
  ``<|endoftext|>`` 0 (bos = eos, never added by encode), ``<|pad|>`` 1, ``<|im_start|>`` 2,
  ``<|im_end|>`` 3.
* llama / mistral -- Llama-2-style SentencePiece BPE with byte fallback: ``<unk>`` 0, ``<s>`` 1
  (added in front by encode), ``</s>`` 2, ``<pad>`` 3, ``<|im_start|>`` 4, ``<|im_end|>`` 5,
  then ``<0x00>``..``<0xFF>`` (6..261) as ordinary tokens, so ``skip_special_tokens`` keeps
  what they spell. As in Llama-2, text after a special token starts with "▁" (a space).

The trained vocabulary has at most MAX_TRAINED_VOCAB tokens; up to the model's vocab_size it is
padded with ordinary filler tokens that decode to " tok<id>" (nothing encodes to them), so
``len(tokenizer) == vocab_size`` and every id a random model emits decodes. The chat template is
ChatML (``<|im_start|>{role}\\n{content}<|im_end|>\\n``; generation prompt
``<|im_start|>assistant\\n``), after ``<s>`` for the llama family; generation_config.json stops on
eos and ``<|im_end|>``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
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
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
BYTE_FALLBACK_ARCHS = ("llama", "mistral")

# --- Synthetic corpus: fixed word lists and a seeded generator, the same on every machine --------

_WORDS = """the of and to in is it that was for on are with as be at by this from have or one had
not but what all were when we there can an your which their said if do will each about how up
out them then she many some so these would other into has more her two like him see time could
no make than first been its who now people my made over did down only way find use may water
long little very after words called just where most know get through back much before go good
new write our used me man too any day same right look think also around another came come work
different away again off went old number great tell men say small every found still between
city play toward five using himself usually server token model cache batch request stream""".split()
_FOREIGN = """你好，世界。 今天天气很好。 我们一起学习中文。 这个模型很小，但是很快。
请问，火车站在哪里？ 東京は日本の首都です。 こんにちは、元気ですか？
ありがとうございます。 猫が好きです。
안녕하세요. 감사합니다. 오늘은 날씨가 좋아요. café naïve façade résumé über São Paulo Zürich
España niño crème brûlée Ångström Dvořák Łódź Ελληνικά Привет, мир! Größe straße déjà vu
el niño pequeño está aquí à bientôt Tschüss fjörd smörgåsbord""".split()
_EMOJI = "😀 😂 🎉 👍 🚀 ❤️ 🔥 ✨ 🐍 🌍 👩‍💻 🇫🇷 🙂 💡 ✅ ⭐ 🍕 📦".split()
_CODE = [
    "def {a}_{b}({a}, {b}=None):\n    return {a} + {n}\n",
    "for i in range({n}):\n    total += values[i] * {f}\n",
    'if {a} > {n} and not {b}:\n    print("{a} {b}", {f})\n',
    '{{"id": {n}, "name": "{a}", "score": {f}, "tags": ["{b}"]}}\n',
    "class {A}{B}:\n    def __init__(self):\n        self.{a} = [{n}, {m}]\n",
    "x = {a}.get('{b}', {n}) // {m}  # {a} {b}\n",
    '<div class="{a}">{b} &amp; {a}</div>\n',
    "SELECT {a}, {b} FROM t WHERE id = {n};\n",
]


def synthetic_corpus(num_lines: int = 6000, seed: int = 1234) -> Iterator[str]:
    """English-ish sentences, code, numbers, CJK, accented Latin and emoji (the same each call)."""
    rng = random.Random(seed)
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen of Python
        import this
    yield from "".join(this.d.get(c, c) for c in this.s).splitlines()
    makers = (_sentence, _sentence, _sentence, _code, _numbers, _foreign)
    for _ in range(num_lines):
        yield rng.choice(makers)(rng)


def _sentence(rng: random.Random) -> str:
    words = rng.choices(_WORDS, k=rng.randint(4, 16))
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), rng.choice(_EMOJI))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice((".", ".", "!", "?", ",", ":"))


def _code(rng: random.Random) -> str:
    a, b = rng.sample(_WORDS, 2)
    n, m = rng.randint(0, 999), rng.randint(1, 64)
    return rng.choice(_CODE).format(
        a=a, b=b, A=a.title(), B=b.title(), n=n, m=m, f=round(rng.uniform(-10, 10), 3)
    )


def _numbers(rng: random.Random) -> str:
    y, m, d, n = rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 99)
    forms = (f"{rng.randint(0, 10**7):,} items", f"{y}-{m:02d}-{d:02d}", f"{m:02d}:{d:02d} +{n}")
    return rng.choice(forms + (f"${rng.uniform(0, 1000):.2f} and {n}%",))


def _foreign(rng: random.Random) -> str:
    parts = rng.choices(_FOREIGN, k=rng.randint(2, 6)) + rng.choices(_EMOJI, k=rng.randint(0, 2))
    rng.shuffle(parts)
    return " ".join(parts)


# --- Tokenizer ------------------------------------------------------------------------------------

# What transformers' Qwen2Tokenizer installs, whatever tokenizer.json says (see engine.tokenizer).
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
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


# --- Model ----------------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOGIT_SCALE = 8.0  # standard deviation of the logits
EMBED_SCALE = 0.25  # input embeddings relative to a unit-gain layer's output
NORM_JITTER = 0.2  # norm weights are uniform in 1 +- NORM_JITTER
QK_SCALE = 2.0  # queries and keys are scaled by this: sharper attention
QK_BIAS_STD = 0.5  # query / key projection biases (qwen2)
BIAS_STD = 0.02  # other biases: they add the same vector at every position, so keep them small
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Architecture-independent sizes; ``head_dim`` None means hidden_size // num_heads."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int | None = None


_SIZE_KEYS = tuple(f.name for f in dataclasses.fields(ModelShape))
# preset -> (shape, its own architecture, other transformers config fields)
PRESETS: dict[str, tuple[ModelShape, str, dict[str, Any]]] = {
    "tiny": (ModelShape(64, 2, 4, 2, 176, 1536, 2048), "llama", {}),
    "small": (ModelShape(1024, 8, 16, 4, 2816, 32000, 4096), "llama", {}),
    "gpt2-124m": (ModelShape(768, 12, 12, 12, 3072, 50257, 1024), "gpt2", {}),
    "llama-3.2-1b": (
        ModelShape(2048, 16, 32, 8, 8192, 128256, 131072, head_dim=64),
        "llama",
        {"tie_word_embeddings": True, "rope_parameters": _LLAMA3_ROPE, "rms_norm_eps": 1e-5},
    ),
}
# The tiny Qwen models tie their embeddings like Qwen2-0.5B / Qwen3-0.6B, and qwen3's head_dim
# is not hidden_size / num_heads, as in real Qwen3 models.
_TINY_TWEAKS: dict[str, dict[str, Any]] = {
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": True, "head_dim": 32},
}


def build_config(
    arch: str | None = None, preset: str = "tiny", **overrides: Any
) -> PretrainedConfig:
    """The transformers config of ``preset`` for ``arch`` (default: the preset's own arch).

    ``overrides`` are ModelShape sizes (hidden_size, num_layers, num_heads, num_kv_heads,
    intermediate_size, vocab_size, max_position_embeddings, head_dim; None = preset's) or any
    other transformers config field (e.g. ``tie_word_embeddings``). Special token ids are those
    of ``arch``'s tokenizer family.
    """
    base, own_arch, preset_fields = PRESETS[preset]
    arch = arch or own_arch
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    explicit = {k: v for k, v in overrides.items() if v is not None}
    fields = {**preset_fields, **(_TINY_TWEAKS.get(arch, {}) if preset == "tiny" else {})}
    fields.update(explicit)
    sizes = {k: fields.pop(k) for k in _SIZE_KEYS if k in fields}
    shape = dataclasses.replace(base, **sizes)
    special = SpecialTokens.for_arch(arch)
    fields.update(
        vocab_size=shape.vocab_size,
        initializer_range=shape.hidden_size**-0.5,
        bos_token_id=special.id_of(special.bos),
        eos_token_id=special.id_of(special.eos),
        pad_token_id=special.id_of(special.pad),
    )
    arch_fields = _gpt2_fields(shape, explicit) if arch == "gpt2" else _rope_fields(arch, shape)
    return AutoConfig.for_model(arch, **arch_fields, **fields)


def _rope_fields(arch: str, shape: ModelShape) -> dict[str, Any]:
    fields = {
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "head_dim": shape.head_dim or shape.hidden_size // shape.num_heads,
    }
    if arch != "llama":
        fields["sliding_window"] = None
    return fields


def _gpt2_fields(shape: ModelShape, explicit: dict[str, Any]) -> dict[str, Any]:
    """GPT-2 has no GQA and no free head_dim; its MLP is 4 x hidden unless asked otherwise."""
    if {"num_kv_heads", "head_dim"} & explicit.keys():
        raise ValueError("gpt2 has no num_kv_heads or head_dim setting")
    return {
        "n_embd": shape.hidden_size,
        "n_layer": shape.num_layers,
        "n_head": shape.num_heads,
        "n_inner": explicit.get("intermediate_size"),
        "n_positions": shape.max_position_embeddings,
    }


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    arch: str | None = None,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    **size_overrides: Any,
) -> str:
    """Write a random ``arch`` model of ``preset``'s shape, with its tokenizer, to ``out_dir``.

    ``arch`` defaults to the preset's own (llama for tiny / small); ``size_overrides`` are as
    for ``build_config``. The same arguments give the same weights (the torch seed is set
    first) and the same tokenizer (trained on a fixed corpus). Returns ``out_dir``.
    """
    out_dir = os.fspath(out_dir)
    config = build_config(arch, preset, **size_overrides)
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
        _shape_weights(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in os.listdir(out_dir):  # written through a 0600 temporary file
        os.chmod(os.path.join(out_dir, name), 0o644)
    max_len = getattr(config, "max_position_embeddings", None) or config.n_positions
    build_tokenizer(config.model_type, config.vocab_size, max_len).save_pretrained(out_dir)
    special = SpecialTokens.for_arch(config.model_type)
    GenerationConfig(
        bos_token_id=special.id_of(special.bos),
        eos_token_id=[special.id_of(special.eos), special.id_of(special.im_end)],
        pad_token_id=special.id_of(special.pad),
    ).save_pretrained(out_dir)
    return out_dir


def _shape_weights(model: torch.nn.Module) -> None:
    """Make transformers' random init useful for tests (the values are measured, see tests).

    * Random norm weights and biases: transformers sets them to 1 and 0, so an engine that
      forgot them would still match it.
    * Sharper attention (queries and keys x QK_SCALE) and small input embeddings: with diffuse
      attention the hidden state barely changes from one position to the next and greedy
      decoding repeats a token; the layers see the embeddings through a norm anyway.
    * Logits with a standard deviation of about LOGIT_SCALE (final norm weight), so the top-1 /
      top-2 gap is wide and greedy tokens do not flip on float rounding.
    """
    decoder = model.get_decoder()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias")):
                param.normal_(0.0, QK_BIAS_STD)
            elif name.endswith(".bias"):
                param.normal_(0.0, BIAS_STD)
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(1.0 - NORM_JITTER, 1.0 + NORM_JITTER)
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight")):
                param.mul_(QK_SCALE)
            elif name.endswith("c_attn.weight"):  # GPT-2's fused [q | k | v] columns
                param[:, : 2 * param.shape[0]].mul_(QK_SCALE)
        for embedding in (model.get_input_embeddings(), getattr(decoder, "wpe", None)):
            if embedding is not None:
                embedding.weight.mul_(EMBED_SCALE)
        row_norm = model.get_output_embeddings().weight.float().norm(dim=1).mean().item()
        final_norm = decoder.ln_f if hasattr(decoder, "ln_f") else decoder.norm
        final_norm.weight.mul_(LOGIT_SCALE / row_norm)


# --- Command line ---------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``make-tiny-model`` on the ``sluice`` command line; ``run`` handles it."""
    parser = subparsers.add_parser("make-tiny-model", help="write a small random model folder")
    parser.add_argument("out_dir", metavar="DIR")
    parser.add_argument(
        "--arch", choices=ARCHS, default=None, help="default: the preset's (llama for tiny/small)"
    )
    parser.add_argument("--preset", choices=tuple(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    for key in _SIZE_KEYS:
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    sizes = {key: getattr(args, key) for key in _SIZE_KEYS}
    path = make_tiny_model(
        args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed, dtype=args.dtype, **sizes
    )
    print(f"wrote {path} in {time.perf_counter() - start:.1f}s")
    return 0
