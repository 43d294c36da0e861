"""Structured outputs: a grammar (JSON schema, regex or EBNF) that constrains what a request
samples, on xgrammar (SGLang's default grammar backend).

A request whose `SamplingParams` name one of `json_schema`, `regex` or `ebnf` gets a `Grammar`:
a matcher, over the tokenizer's vocabulary, of the output so far. Per step the batch's grammar
rows get a token bitmask (`vocab_mask`: bit v of a row set = token v may come next) that the
sampler applies to the logits after penalties and logit_bias, before greedy, sampling and
logprobs (where SGLang applies its vocab mask); every token appended to the request is then
accepted by its matcher (`OutputProcessor`). Once the grammar is complete only the model's
stop tokens are allowed, and accepting one ends it: the request finishes with "stop"
(`Req.check_finished`), `ignore_eos` or not.

The mask of a step needs the previous token accepted, so with the overlap scheduler a batch
holding a grammar request is sampled deferred, after the batch before it is processed (as for
penalties); its forward still overlaps.

Compiling (and building the backend, for the first grammar request) happens off the
scheduler's thread, in the scheduler's `GrammarQueue` (engine/scheduler/grammar_queue.py), so a
slow schema does not stall the requests that run meanwhile; compiled grammars are cached there,
and requests with the same grammar only pay for a new matcher.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from engine.sampling.grammar_spec import ANY_JSON, grammar_spec, structural_tag_json

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:NN: " and may go on with a failed
# check's condition ("Check failed: (...) is false: "); the rest is the message
_CPP_PREFIX = re.compile(r"^(?:\[[\d:]+\]\s+\S+:\d+:\s*)?(?:Check failed: \(.*?\) is false:\s*)?")


class Grammar:
    """One request's matcher: which tokens may follow what it has accepted so far."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarBackend:
    """Compiles grammars for one tokenizer and model vocabulary (rows of the logits past the
    tokenizer's own vocabulary are never allowed), and fills a batch's masks (`vocab_mask`)
    in one call, on `mask_threads` threads ("auto": half the cores)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_threads: int = 1,
        mask_threads: int | str = "auto",
    ) -> None:
        try:
            import xgrammar
        except ImportError as exc:
            raise ValueError("structured outputs need the xgrammar package") from exc
        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        # compiled grammars are cached by the scheduler's `GrammarQueue`, with a bound
        self._compiler = xgrammar.GrammarCompiler(
            info, max_threads=max_threads, cache_enabled=False
        )
        self._batch = xgrammar.BatchGrammarMatcher(mask_threads)

    def grammar(self, params: Any) -> Grammar | None:
        """A fresh matcher for `params`' grammar (None without one); ValueError naming the
        field if it does not compile."""
        spec = grammar_spec(params)
        return None if spec is None else self.matcher(self.compile(spec))

    def matcher(self, compiled: Any) -> Grammar:
        """A fresh matcher of a compiled grammar (cheap; one per request)."""
        return Grammar(self._xgr.GrammarMatcher(compiled))

    def compile(self, spec: tuple[str, str]) -> Any:
        """The compiled grammar of `spec` ((kind, text) of `grammar_spec`): ValueError naming
        the field if it does not compile. Thread-safe; xgrammar releases the GIL while it
        compiles, so other threads (the scheduler's) keep running."""
        kind, text = spec
        compiler = self._compiler
        try:
            if kind == "json_schema":
                if text == ANY_JSON:
                    compiled = compiler.compile_builtin_json_grammar()
                else:
                    compiled = compiler.compile_json_schema(text)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "structural_tag":
                compiled = compiler.compile_structural_tag(structural_tag_json(text))
            else:
                compiled = compiler.compile_grammar(text)
        except RuntimeError as exc:
            raise ValueError(f"{kind}: {_CPP_PREFIX.sub('', str(exc).strip())}") from None
        return compiled

    def vocab_mask(
        self, grammars: Sequence[Grammar | None]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, bitmask) of a batch: the rows with a live grammar and, for each, int32 words
        of 32 tokens (bit v % 32 of word v // 32 set: token v allowed); None without any."""
        rows = [i for i, g in enumerate(grammars) if g is not None and not g.is_terminated()]
        if not rows:
            return None
        mask = torch.empty((len(rows), (self.vocab_size + 31) // 32), dtype=torch.int32)
        matchers = [grammars[i].matcher for i in rows]  # type: ignore[union-attr]
        self._batch.batch_fill_next_token_bitmask(matchers, mask)
        return torch.tensor(rows, dtype=torch.int64), mask


_BIT = torch.arange(32, dtype=torch.int32)


def apply_vocab_mask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] with the tokens `mask` forbids in `rows` set to -inf (a new tensor)."""
    vocab = logits.shape[1]
    bits = mask.unsqueeze(-1).bitwise_right_shift(_BIT.to(mask.device)).bitwise_and_(1)
    return allow_only(logits, rows, bits.view(mask.shape[0], -1)[:, :vocab].bool())


def allow_only(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] with the tokens not `allowed` [len(rows), V] in `rows` set to -inf
    (a new tensor)."""
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)
