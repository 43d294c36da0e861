"""``sluice make-tiny-model --arch bert|xlm-roberta``: tiny random encoder models (embedding
models and cross-encoder classifiers) saved as real Hugging Face folders.

An embedding model (``num_labels`` None) is ``BertModel`` / ``XLMRobertaModel`` plus the
sentence-transformers files that say how to pool it (modules.json, 1_Pooling/config.json,
sentence_bert_config.json): CLS or mean pooling, then L2 normalisation. A classifier is
``*ForSequenceClassification`` with ``num_labels`` outputs and no sentence-transformers files.

Why the tokenizers are built the way they are: transformers 5 loads these folders through
``BertTokenizer`` / ``XLMRobertaTokenizer``, which take only the vocabulary from tokenizer.json
and rebuild the rest of the pipeline from the class definition (normalizer, pre-tokenizer,
decoder, post-processor, and for XLM-R a Unigram model whose ``<unk>`` is always id 3). sluice's
``engine.tokenizer.load_tokenizer`` reads tokenizer.json as saved. So the trained pipeline *is*
the one each class builds, and both loaders agree with the raw ``tokenizers.Tokenizer``:

* bert: WordPiece; BertNormalizer (lowercase, accents stripped, CJK split) + BertPreTokenizer;
  ``[PAD]`` 0, ``[UNK]`` 1, ``[CLS]`` 2, ``[SEP]`` 3, ``[MASK]`` 4; ``[CLS] A [SEP] B [SEP]``
  with token types 0 for ``[CLS] A [SEP]`` and 1 for ``B [SEP]``.
* xlm-roberta: Unigram, no normalizer, WhitespaceSplit + Metaspace (``▁`` before every word);
  ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, ``<mask>`` last; ``<s> A </s></s> B </s>``,
  all token types 0.

The tokenizers library's trainers are not deterministic (hash-map order breaks ties between
equal counts, and the Unigram trainer's float sums vary), so both vocabularies come from a BPE
run made deterministic (every ``##`` continuation character is reserved up front, so no id is
handed out in hash order); XLM-R's Unigram scores are the log frequencies of those pieces in the
BPE segmentation of the corpus.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from typing import Any

import torch
from tokenizers import (
    AddedToken,
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
    AutoModel,
    AutoModelForSequenceClassification,
    BertTokenizerFast,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    XLMRobertaTokenizerFast,
)

from services.tiny_classifier import SCORE_SCALE
from services.tiny_corpus import synthetic_corpus

ENCODER_ARCHS = ("bert", "xlm-roberta")
POOLING_MODES = ("cls", "mean")
TARGET_VOCAB = 1536  # the trainers' target; the model's vocab_size is what they produce
MAX_LEN = 512  # tokens, special tokens included
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
XLMR_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # then <mask>, the last id
UNIGRAM_FLOOR = 1.0  # pieces the BPE segmentation never ends on count as this many occurrences
NUM_CALIBRATION_PAIRS = 32  # corpus pairs the classifier's logits are scaled on
# Weights have std INIT_GAIN / sqrt(hidden) (each linear map multiplies norms by about
# INIT_GAIN). With transformers' default 0.02 the tiny model's attention is so flat that the
# [CLS] output is the same for every text (cosine 1.000 between corpus sentences); with this,
# the cosine between pooled embeddings of corpus sentences is 0.65-0.98 (bfloat16 moves each
# embedding by < 1e-3 in cosine).
INIT_GAIN = 1.5
NORM_JITTER = 0.2  # LayerNorm gains are uniform in 1 +- NORM_JITTER
BIAS_STD = 0.05


_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# small: the shape of all-MiniLM-L6-v2 / ms-marco-MiniLM-L-6-v2
ENCODER_PRESETS = {"tiny": (64, 2, 4, 176), "small": (384, 6, 12, 1536)}


def make_tiny_encoder(
    out_dir: str | os.PathLike[str],
    arch: str,
    preset: str = "tiny",
    seed: int = 0,
    num_labels: int | None = None,
    pooling: str = "cls",
) -> str:
    """Write a random ``arch`` encoder of ``preset``'s shape, with its tokenizer, to ``out_dir``.

    ``num_labels`` None: an embedding model pooled by ``pooling`` ("cls" or "mean"); N: a
    sequence classifier with N labels (``pooling`` unused). The same arguments give the same
    folder (float32 weights seeded by ``seed``, a tokenizer trained on a fixed corpus).
    Returns ``out_dir``.
    """
    if arch not in ENCODER_ARCHS:
        raise ValueError(f"unknown encoder arch {arch!r}; choose from {ENCODER_ARCHS}")
    if preset not in ENCODER_PRESETS:
        raise ValueError(f"no {preset!r} preset for encoders; choose from {tuple(ENCODER_PRESETS)}")
    if pooling not in POOLING_MODES:
        raise ValueError(f"unknown pooling {pooling!r}; choose from {POOLING_MODES}")
    if num_labels is not None and num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")
    out_dir = os.fspath(out_dir)
    raw = train_encoder_tokenizer(arch)
    tokenizer = wrap_tokenizer(arch, raw)
    config = build_encoder_config(arch, preset, raw.get_vocab_size(), num_labels)
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        auto = AutoModel if num_labels is None else AutoModelForSequenceClassification
        model = auto.from_config(config, dtype=torch.float32)
        _jitter_norms_and_biases(model)
        if num_labels is not None:
            _calibrate_classifier(model, tokenizer)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if num_labels is None:
        _write_sentence_transformers(out_dir, config.hidden_size, pooling)
    for root, _, names in os.walk(out_dir):  # some are written through 0600 temporary files
        for name in names:
            os.chmod(os.path.join(root, name), 0o644)
    return out_dir


def check_encoder_options(dtype: str, size_overrides: dict[str, Any]) -> None:
    """Reject ``make_tiny_model`` options that only decoders have (size overrides, dtypes)."""
    given = sorted(k for k, v in size_overrides.items() if v is not None)
    if given or dtype != "float32":
        raise ValueError(f"encoders are float32 presets only; got dtype {dtype}, sizes {given}")


def build_encoder_config(
    arch: str, preset: str, vocab_size: int, num_labels: int | None = None
) -> PretrainedConfig:
    """The transformers config; XLM-R's position ids start after its pad id (1), hence 514
    position embeddings for 512 tokens."""
    fields: dict[str, Any] = dict(zip(_SHAPE_KEYS, ENCODER_PRESETS[preset]))
    fields.update(
        vocab_size=vocab_size,
        hidden_act="gelu",
        initializer_range=INIT_GAIN * fields["hidden_size"] ** -0.5,
    )
    if arch == "bert":
        fields.update(max_position_embeddings=MAX_LEN, type_vocab_size=2, pad_token_id=0)
    else:
        fields.update(
            max_position_embeddings=MAX_LEN + 2, type_vocab_size=1, layer_norm_eps=1e-5,
            pad_token_id=1, bos_token_id=0, eos_token_id=2,
        )  # fmt: skip
    if num_labels is not None:
        fields["num_labels"] = num_labels
    return AutoConfig.for_model(arch, **fields)


def _jitter_norms_and_biases(model: torch.nn.Module) -> None:
    """Random LayerNorm gains and biases everywhere: transformers sets them to 1 and 0, so an
    engine that forgot one would still match it."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, BIAS_STD)
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(1.0 - NORM_JITTER, 1.0 + NORM_JITTER)


def _calibrate_classifier(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast) -> None:
    """Scale and shift the last classifier layer so that each label's logits over corpus pairs
    have mean 0 and standard deviation SCORE_SCALE: a random head gives logits near 0 (every
    sigmoid about 0.5), and one shifted far from 0 gives every sigmoid 0 or 1."""
    head = model.classifier  # bert: a Linear; xlm-roberta: dense -> tanh -> out_proj
    last = head if isinstance(head, torch.nn.Linear) else head.out_proj
    lines = [line for line in synthetic_corpus() if line.strip()]
    n = NUM_CALIBRATION_PAIRS
    batch = tokenizer(lines[:n], lines[n : 2 * n], padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits  # (n, num_labels)
        scale = SCORE_SCALE / logits.std(dim=0)
        last.weight.mul_(scale[:, None])
        last.bias.sub_(logits.mean(dim=0)).mul_(scale)


def _write_sentence_transformers(out_dir: str, hidden_size: int, pooling: str) -> None:
    """The files sentence-transformers writes for Transformer -> Pooling -> Normalize."""
    kinds = ("Transformer", "Pooling", "Normalize")
    paths = ("", "1_Pooling", "2_Normalize")
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate(zip(kinds, paths))
    ]
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken")  # fmt: skip
    chosen = {"cls": "cls_token", "mean": "mean_tokens"}[pooling]
    pooling_config = {
        "word_embedding_dimension": hidden_size,
        **{f"pooling_mode_{mode}": mode == chosen for mode in modes},
        "include_prompt": True,
    }
    os.makedirs(os.path.join(out_dir, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "2_Normalize"), exist_ok=True)  # Normalize saves nothing
    _write_json(os.path.join(out_dir, "modules.json"), modules)
    _write_json(os.path.join(out_dir, "1_Pooling", "config.json"), pooling_config)
    _write_json(
        os.path.join(out_dir, "sentence_bert_config.json"),
        {"max_seq_length": MAX_LEN, "do_lower_case": False},
    )


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


# --- Tokenizer ------------------------------------------------------------------------------------


def train_encoder_tokenizer(arch: str) -> Tokenizer:
    """The raw tokenizer of ``arch`` (the same on every machine): its vocabulary, and exactly
    the pipeline that transformers' tokenizer class for ``arch`` builds around it."""
    corpus = list(synthetic_corpus())
    if arch == "bert":
        vocab = _train_bpe_vocab(_with_pipeline(Tokenizer(models.BPE()), arch), corpus, "##")
        model = models.WordPiece(dict(vocab), unk_token="[UNK]")
        specials = BERT_SPECIALS
    else:
        pieces = _train_unigram_pieces(corpus)
        model = models.Unigram(pieces, unk_id=XLMR_SPECIALS.index("<unk>"), byte_fallback=False)
        specials = (*XLMR_SPECIALS, "<mask>")
    tokenizer = _with_pipeline(Tokenizer(model), arch)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


def wrap_tokenizer(arch: str, raw: Tokenizer) -> PreTrainedTokenizerFast:
    """``raw`` as the transformers tokenizer class of ``arch`` (right padding, 512 tokens)."""
    common = {"model_max_length": MAX_LEN, "padding_side": "right"}
    if arch == "bert":
        # (as a real BERT folder: a loader reading tokenizer.json as a plain
        # PreTrainedTokenizerFast, engine.tokenizer's, gives token types only when asked)
        return BertTokenizerFast(
            tokenizer_object=raw, do_lower_case=True, tokenize_chinese_chars=True,
            strip_accents=None, **common,
        )  # fmt: skip
    return XLMRobertaTokenizerFast(tokenizer_object=raw, add_prefix_space=True, **common)


def _with_pipeline(tokenizer: Tokenizer, arch: str) -> Tokenizer:
    """What ``BertTokenizer`` / ``XLMRobertaTokenizer`` install (see the module docstring)."""
    if arch == "bert":
        tokenizer.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
        )
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece(prefix="##")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS]:0 $A:0 [SEP]:0",
            pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
            special_tokens=[(t, BERT_SPECIALS.index(t)) for t in ("[CLS]", "[SEP]")],
        )
        return tokenizer
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace("\u2581", "always")]
    )
    tokenizer.decoder = decoders.Metaspace("\u2581", "always")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["<s>", "$A", "</s>"],
        pair=["<s>", "$A", "</s>", "</s>", "$B", "</s>"],
        special_tokens=[(t, XLMR_SPECIALS.index(t)) for t in ("<s>", "</s>")],
    )
    return tokenizer


def _train_bpe_vocab(
    probe: Tokenizer, corpus: list[str], prefix: str | None
) -> list[tuple[str, int]]:
    """Deterministic BPE on ``corpus`` with ``probe``'s normalizer and pre-tokenizer: (token,
    id) in id order, special tokens first. Ids are handed out as the trainer first meets a
    character in hash order, so every character (and, with a continuation ``prefix``, every
    prefixed character) is given up front, in code point order."""
    words = [w for line in corpus for w, _ in probe.pre_tokenizer.pre_tokenize_str(
        probe.normalizer.normalize_str(line) if probe.normalizer else line)]  # fmt: skip
    alphabet = sorted({c for w in words for c in w})
    reserved = list(BERT_SPECIALS if prefix else XLMR_SPECIALS)
    if prefix:
        reserved += [prefix + c for c in sorted({c for w in words for c in w[1:]})]
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB - (0 if prefix else 1),  # XLM-R appends <mask>
        min_frequency=2,
        special_tokens=reserved,
        initial_alphabet=alphabet,
        show_progress=False,
        **({"continuing_subword_prefix": prefix} if prefix else {}),
    )
    probe.train_from_iterator(corpus, trainer)
    vocab = json.loads(probe.to_str())["model"]["vocab"]
    return sorted(vocab.items(), key=lambda kv: kv[1])


def _train_unigram_pieces(corpus: list[str]) -> list[tuple[str, float]]:
    """XLM-R's (piece, log probability) list: the BPE vocabulary, scored by how often each
    piece occurs in the BPE segmentation of the corpus; special tokens score 0 (as XLM-R's)."""
    bpe = _with_pipeline(Tokenizer(models.BPE()), "xlm-roberta")
    vocab = _train_bpe_vocab(bpe, corpus, None)
    encodings = bpe.encode_batch(corpus, add_special_tokens=False)
    counts = Counter(token for encoding in encodings for token in encoding.tokens)
    total = sum(counts.values())
    pieces = [(t, 0.0) for t in XLMR_SPECIALS]
    for token, _ in vocab[len(XLMR_SPECIALS) :]:
        pieces.append((token, round(math.log(max(counts[token], UNIGRAM_FLOOR) / total), 6)))
    return [*pieces, ("<mask>", 0.0)]
