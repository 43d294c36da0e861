"""Logprobs in the API's shapes: token ids as text (`TokenNames`), OpenAI's chat entries and
completion logprobs, SGLang's `/generate` object with its `input_token_logprobs`, vLLM's
`prompt_logprobs`."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from shared.messages import PromptLogprobs

if TYPE_CHECKING:
    from services.router_stream import Choice

logger = logging.getLogger(__name__)


class TokenNames:
    """Token id → its text, for logprobs: decoded with the model's `tokenizer.json` once the
    router has found one (its `--model`, or a worker's model folder on this machine), else
    vLLM's `token_id:N` spelling."""

    def __init__(self) -> None:
        self._decode: Any = None
        self._tokenizer: Any = None
        self._tried: set[str] = set()

    def load(self, model_dirs: Iterable[str]) -> None:
        for folder in model_dirs:
            if self._decode is not None or folder in self._tried:
                continue
            self._tried.add(folder)
            path = os.path.join(folder, "tokenizer.json")
            if not os.path.isfile(path):
                continue
            try:
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(path)
            except Exception as exc:  # a broken or foreign file: keep the fallback
                logger.warning("cannot load %s for logprob tokens: %s", path, exc)
                continue
            self._tokenizer = tok
            self._decode = functools.lru_cache(maxsize=1 << 16)(functools.partial(_decode_one, tok))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id) if self._decode else f"token_id:{token_id}"

    def text(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of a token sequence (an echoed prompt given as ids)."""
        if self._tokenizer is None:
            return "".join(map(self, ids))
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


AS_TOKEN_IDS = TokenNames()  # never loads a tokenizer: every token is `token_id:N`


def sglang_entry(logprob: float | None, token_id: int, names: TokenNames | None) -> list:
    """One entry of SGLang's logprob lists: `[logprob, token id, text]`, the text None unless
    the request asked for it (`return_text_in_logprobs`: `names` given)."""
    return [logprob, token_id, None if names is None else names(token_id)]


def input_logprobs(
    prompt: PromptLogprobs, top: bool, names: TokenNames | None = None
) -> dict[str, Any]:
    """SGLang's `input_token_logprobs` (and `input_top_logprobs`) of `meta_info`."""
    pairs = zip(prompt.token_logprobs(), prompt.ids, strict=True)
    out: dict[str, Any] = {"input_token_logprobs": [sglang_entry(lp, t, names) for lp, t in pairs]}
    tops = prompt.top_pairs()
    if top and tops is not None:
        out["input_top_logprobs"] = [
            None if row is None else [sglang_entry(v, t, names) for t, v in row] for row in tops
        ]
    return out


def ranked_prompt(prompt: PromptLogprobs, k: int, names: TokenNames) -> list[Any]:
    """vLLM's `prompt_logprobs`: None for the prompt's first token, then for each token a map
    from token id to `{"logprob", "rank", "decoded_token"}` holding the token itself (first)
    and the `k` best candidates (ranks 1..k)."""
    out: list[Any] = list(prompt.none_first)
    ids = prompt.ids[len(out) :]
    tops = (prompt.top_pairs() or [])[len(out) :] or [None] * len(ids)
    ranks = prompt.ranks or [None] * len(ids)
    for tid, lp, rank, top in zip(ids, prompt.logprobs, ranks, tops, strict=True):
        entry = {tid: {"logprob": lp, "rank": rank, "decoded_token": names(tid)}}
        for j, (t, v) in enumerate((top or [])[:k]):
            entry.setdefault(t, {"logprob": v, "rank": j + 1, "decoded_token": names(t)})
        out.append(entry)
    return out


def _decode_one(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def openai_logprobs(
    names: TokenNames,
    chat: bool,
    top_n: int,
    ids: list[int],
    lps: list[float | None],
    tops: list[list[tuple[int, float]] | None],
) -> dict[str, Any]:
    """OpenAI's `logprobs` of a choice: chat's `content` entries, or the completions API's
    `tokens`, `token_logprobs`, `top_logprobs` and `text_offset`."""
    if chat:
        content = []
        for i, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
            top = tops[i][:top_n] if i < len(tops) else []
            entry = chat_token(names(tid), lp)
            entry["top_logprobs"] = [chat_token(names(t), v) for t, v in top]
            content.append(entry)
        return {"content": content}
    tokens = [names(t) for t in ids]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top_maps = [
        None if top is None else {names(t): v for t, v in top[:top_n]} for top in tops
    ] or None
    return {
        "tokens": tokens,
        "token_logprobs": lps[: len(ids)],
        "top_logprobs": top_maps,
        "text_offset": offsets,
    }


def generate_obj(
    c: Choice,
    text: str,
    start: int,
    want_logprobs: bool,
    top_n: int,
    names: TokenNames | None = None,
    weight_version: str | None = None,
) -> dict[str, Any]:
    """`/generate`'s object for `c`'s output tokens from `start` on (`text` is theirs):
    ids and logprobs are sliced there, counts and the finish reason are the whole output's.
    Logprob entries are SGLang's `[logprob, token id, text]`, the text None without `names`
    (SGLang's `return_text_in_logprobs`); `weight_version`: the deployment's now (SGLang's)."""
    reason, num_ids = c.finish_reason, len(c.output_ids)
    ids = c.output_ids[start:]
    meta: dict[str, Any] = {
        "id": c.rid,
        "finish_reason": reason.to_dict(length=num_ids) if reason else None,
        "prompt_tokens": c.usage.prompt_tokens if c.usage else None,
        "completion_tokens": c.usage.completion_tokens if c.usage else num_ids,
        "cached_tokens": c.usage.cached_tokens if c.usage else None,
    }
    if c.e2e_latency is not None:  # SGLang's, once the request has ended
        meta["e2e_latency"] = c.e2e_latency
    if weight_version is not None:
        meta["weight_version"] = weight_version
    if want_logprobs:
        pairs = zip(c.token_logprobs[start:], ids, strict=False)
        meta["output_token_logprobs"] = [sglang_entry(lp, t, names) for lp, t in pairs]
        if top_n:
            tops = c.top_logprobs[start:]
            meta["output_top_logprobs"] = [
                [sglang_entry(v, t, names) for t, v in top] for top in tops
            ]
        if c.prompt is not None and start == 0:
            meta.update(input_logprobs(c.prompt, top_n > 0, names))
    return {"text": text, "output_ids": ids, "meta_info": meta}
