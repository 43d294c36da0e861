"""Per-request sampling parameters, with SGLang's names, defaults and valid ranges.

`SamplingParams` is plain data: the message layer converts it with `to_dict()` /
`from_dict()`. `verify()` checks ranges; `normalize()` rewrites to the canonical form
(greedy as `top_k=1, temperature=1.0`, `top_k=-1` as `TOP_K_ALL`, `stop` as a list).
`SamplingBatchInfo` accepts both raw and normalized params.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.sampling.grammar_spec import GRAMMAR_KINDS, grammar_error

# Below this temperature a request is greedy (SGLang's _SAMPLING_EPS).
SAMPLING_EPS = 1e-6
# top_k meaning "the whole vocabulary"; the batch builder clamps it to vocab_size.
TOP_K_ALL = 1 << 30
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    # EOS and stop tokens are banned until this many tokens are out, and stop strings are
    # only looked for from then on (vLLM's min_tokens); a grammar's end is not held back
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    # keep the matched stop string at the end of the text (SGLang's no_stop_trim; vLLM's
    # include_stop_str_in_output); a stop token's text is kept in either case unless special
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # with return_logprob: the prompt position from which the prompt tokens' logprobs are
    # returned too (SGLang's request field; -1: none, output tokens only)
    logprob_start_len: int = -1
    # with prompt logprobs: each scored prompt token's rank too (vLLM's prompt_logprobs)
    return_prompt_ranks: bool = False
    # token id (a decimal string, as in OpenAI's JSON) -> added to its logit before sampling
    # and logprobs; +-100 in practice forces or bans the token
    logit_bias: dict[str, float] | None = None
    # only these tokens may be sampled (vLLM's allowed_token_ids; logprobs see the others as
    # impossible too)
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words as token sequences (never completed: engine/sampling/logit_bans.py)
    bad_words_ids: list[list[int]] | None = None
    # structured output (engine/sampling/grammar_spec.py), at most one: a JSON schema (as a
    # JSON string; "$$ANY$$" for any JSON), a regular expression, an EBNF grammar or an
    # xgrammar structural tag (JSON)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    n: int = 1
    # an embedding request's vector L2-normalised (vLLM's pooling `normalize`); None: the
    # model's way (an embedding model normalises, a classifier returns raw logits)
    normalize_embedding: bool | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def has_bad_word_prefixes(self) -> bool:
        """Some bad word is longer than one token: its ban depends on the output so far."""
        return any(len(word) > 1 for word in self.bad_words_ids or ())

    @property
    def needs_history(self) -> bool:
        """Sampling reads the output so far on the host: a grammar's mask (the overlap
        scheduler defers it). Penalties and bad words read the history the device keeps."""
        return self.has_grammar

    @property
    def has_device_history(self) -> bool:
        """The overlap scheduler keeps this request's history on the device: penalty counts,
        or the last tokens a bad word of several tokens is matched against."""
        return self.has_penalty or self.has_bad_word_prefixes

    @property
    def has_grammar(self) -> bool:
        return any(getattr(self, kind) is not None for kind in GRAMMAR_KINDS)

    @property
    def stop_strs(self) -> list[str]:
        """`stop` as a list, whether or not the params were normalized."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field that is out of range."""
        checks: list[tuple[bool, str, str]] = [
            (self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0"),
            (
                0 <= self.min_new_tokens <= self.max_new_tokens,
                "min_new_tokens",
                f"must be in [0, max_new_tokens = {self.max_new_tokens}]",
            ),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (disabled) or >= 1"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (self.top_logprobs_num >= 0, "top_logprobs_num", "must be >= 0"),
            (self.logprob_start_len >= -1, "logprob_start_len", "must be >= -1"),
            (self.n >= 1, "n", "must be >= 1"),
            (all(s for s in self.stop_strs), "stop", "must not contain empty strings"),
            (self.allowed_token_ids != [], "allowed_token_ids", "must not be empty"),
            (all(self.bad_words_ids or [[0]]), "bad_words_ids", "must not hold empty sequences"),
        ]
        if self.sampling_seed is not None:
            ok = _INT64_MIN <= self.sampling_seed <= _INT64_MAX
            checks.append((ok, "sampling_seed", "must fit in a signed 64-bit integer"))
        if self.logit_bias:
            why = logit_bias_error(self.logit_bias)
            checks.append((why is None, "logit_bias", why or ""))
        if self.has_grammar and (bad := grammar_error(self)) is not None:
            checks.append((False, *bad))
        if vocab_size is not None:
            ids_ok = all(0 <= t < vocab_size for t in self.stop_token_ids or [])
            checks.append((ids_ok, "stop_token_ids", f"must be in [0, {vocab_size})"))
            ids_ok = all(0 <= t < vocab_size for t in self.allowed_token_ids or [])
            checks.append((ids_ok, "allowed_token_ids", f"must be in [0, {vocab_size})"))
            words = self.bad_words_ids or []
            ids_ok = all(0 <= t < vocab_size for word in words for t in word)
            checks.append((ids_ok, "bad_words_ids", f"must be in [0, {vocab_size})"))
            k_ok = self.top_logprobs_num <= vocab_size
            checks.append((k_ok, "top_logprobs_num", f"must be <= vocab size {vocab_size}"))
            keys = [k for k in self.logit_bias or {} if _is_token_key(k)]
            bias_in = all(0 <= int(k) < vocab_size for k in keys)
            checks.append((bias_in, "logit_bias", f"token ids must be in [0, {vocab_size})"))
        for ok, name, why in checks:
            if not ok:
                got = repr(getattr(self, name))
                got = got if len(got) <= 200 else got[:200] + "..."
                raise ValueError(f"{name} {why}, got {got}")

    def logit_bias_ids(self) -> list[int]:
        """The token ids `logit_bias` names, in its order (keys checked by `verify`)."""
        return [int(k) for k in self.logit_bias or {}]

    def normalize(self) -> SamplingParams:
        """Rewrite in place to the canonical form and return self (idempotent, as SGLang).

        Greedy becomes `temperature=1.0, top_k=1`; `top_k=-1` becomes `TOP_K_ALL`; `stop`
        becomes a list and `stop_token_ids` a list.
        """
        if self.is_greedy:
            self.temperature, self.top_k = 1.0, 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL
        self.stop = self.stop_strs
        self.stop_token_ids = list(self.stop_token_ids or [])
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a plain dict; unknown keys and wrong types raise ValueError."""
        for key, value in d.items():
            if key not in _FIELD_TYPES:
                raise ValueError(f"unknown sampling parameter {key!r}")
            if not _type_ok(_FIELD_TYPES[key], value):
                raise ValueError(
                    f"{key} has wrong type {type(value).__name__}, expected {_FIELD_TYPES[key]}"
                )
        kwargs = {k: float(v) if _FIELD_TYPES[k] == "float" else v for k, v in d.items()}
        for key in ("stop", "stop_token_ids", "allowed_token_ids"):
            if isinstance(kwargs.get(key), (list, tuple)):
                kwargs[key] = list(kwargs[key])
        if kwargs.get("bad_words_ids") is not None:
            kwargs["bad_words_ids"] = [list(word) for word in kwargs["bad_words_ids"]]
        if kwargs.get("logit_bias"):
            kwargs["logit_bias"] = {k: float(v) for k, v in kwargs["logit_bias"].items()}
        return cls(**kwargs)


_FIELD_TYPES: dict[str, str] = {
    "max_new_tokens": "int",
    "min_new_tokens": "int",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float",
    "stop": "str | list[str] | None",
    "stop_token_ids": "list[int] | None",
    "ignore_eos": "bool",
    "repetition_penalty": "float",
    "frequency_penalty": "float",
    "presence_penalty": "float",
    "sampling_seed": "int | None",
    "normalize_embedding": "bool | None",
    "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool",
    "no_stop_trim": "bool",
    "return_logprob": "bool",
    "top_logprobs_num": "int",
    "logprob_start_len": "int",
    "return_prompt_ranks": "bool",
    "logit_bias": "dict[str, float] | None",
    "allowed_token_ids": "list[int] | None",
    "bad_words_ids": "list[list[int]] | None",
    "json_schema": "str | None",
    "regex": "str | None",
    "ebnf": "str | None",
    "structural_tag": "str | None",
    "n": "int",
}
assert set(_FIELD_TYPES) == {f.name for f in dataclasses.fields(SamplingParams)}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_token_key(k: str) -> bool:
    return k.isascii() and k.isdigit() and len(k) < 12


def logit_bias_error(bias: dict[str, float]) -> str | None:
    """Why `bias` is not OpenAI's form (token ids as decimal strings, biases in [-100,
    100]), or None; the vocabulary is `verify`'s to check."""
    for key, value in bias.items():
        if not _is_token_key(key):
            return f"keys must be token ids, got {key!r}"
        if not -100.0 <= value <= 100.0:
            return f"biases must be in [-100, 100], got {value!r} for {key}"
    return None


def _type_ok(spec: str, v: Any) -> bool:
    if v is None:
        return spec.endswith("| None")
    if spec.startswith("int"):
        return _is_int(v)
    if spec == "float":
        return _is_int(v) or isinstance(v, float)
    if spec.startswith("bool"):
        return isinstance(v, bool)
    if spec == "str | None":
        return isinstance(v, str)
    if spec.startswith("str"):
        return isinstance(v, str) or (
            isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v)
        )
    if spec.startswith("list[list[int]]"):
        return isinstance(v, (list, tuple)) and all(_type_ok("list[int]", w) for w in v)
    if spec.startswith("list[int]"):
        return isinstance(v, (list, tuple)) and all(_is_int(t) for t in v)
    if spec.startswith("dict[str, float]"):
        return isinstance(v, dict) and all(
            isinstance(k, str) and (_is_int(x) or isinstance(x, float)) for k, x in v.items()
        )
    raise AssertionError(f"no type check for {spec}")
