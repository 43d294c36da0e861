"""SGLang's `/generate` body: `text` or `input_ids`, one prompt or a batch, with its
`sampling_params` (one for all prompts or one each), logprob options, `rid`, `priority`,
`lora_path` and `extra_key` (a cache salt), validated and split into the router's
sub-requests (services/router_protocol.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, field_validator

from engine.sampling.grammar_spec import structural_tag_json
from services.router_fields import (
    _INT64,
    MAX_LOGPROBS,
    ApiError,
    CacheSalt,
    RequestId,
    _SamplingCore,
    _Strict,
)
from services.router_protocol import SubRequest, _is_id_list, fan_out


class GenerateSampling(_SamplingCore):
    """SGLang's `sampling_params` of `/generate`; unknown keys are refused."""

    model_config = ConfigDict(strict=True, extra="forbid")
    max_new_tokens: int | None = Field(None, ge=0)
    min_new_tokens: int | None = Field(None, ge=0)
    sampling_seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    json_schema: str | None = None  # structured output, besides regex and ebnf
    structural_tag: str | None = None  # (JSON, xgrammar's form or the legacy one)

    @field_validator("structural_tag")
    @classmethod
    def _canonical_tag(cls, v: str | None) -> str | None:
        return None if v is None else structural_tag_json(v)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, exclude={"n"})


class GenerateRequest(_Strict):
    """SGLang's `/generate`: `text` or `input_ids`, one prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: Any = None
    sampling_params: GenerateSampling | list[GenerateSampling] | None = None
    stream: bool | None = False
    return_logprob: bool | None = False
    top_logprobs_num: int | None = Field(0, ge=0, le=MAX_LOGPROBS)
    # each logprob entry [logprob, token id, text] with the token's text (else None there)
    return_text_in_logprobs: bool | None = False
    # with return_logprob, the prompt's logprobs from this position (-1: none); one per
    # prompt, or one for all
    logprob_start_len: int | list[int] | None = -1
    rid: RequestId | list[RequestId] | None = None  # one per prompt: meta_info.id, /abort_request
    priority: int | None = Field(None, ge=-_INT64, lt=_INT64)
    # SGLang's: the LoRA adapter (by name) of every prompt, or one each (None: the base model)
    lora_path: str | list[str | None] | None = None
    # SGLang's cache salt: cached prefixes are reused only by requests with the same key;
    # one for every prompt, or one each (None: unsalted)
    extra_key: CacheSalt | list[CacheSalt | None] | None = None

    @field_validator("logprob_start_len")
    @classmethod
    def _check_start(cls, v: Any) -> Any:
        if any(s < -1 for s in (v if isinstance(v, list) else [v or 0])):
            raise ValueError("must be >= -1")
        return v

    @field_validator("input_ids")
    @classmethod
    def _check_ids(cls, v: Any) -> Any:
        if v is None or _is_id_list(v) or (isinstance(v, list) and v and all(map(_is_id_list, v))):
            return v
        raise ValueError("must be a non-empty list of token ids or a list of such lists")

    @property
    def is_batch(self) -> bool:
        return isinstance(self.text, list) or (
            self.input_ids is not None and isinstance(self.input_ids[0], list)
        )

    def to_subrequests(self) -> list[SubRequest]:
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "pass exactly one of text and input_ids", "text", "invalid_value")
        if self.text is not None:
            texts = self.text if isinstance(self.text, list) else [self.text]
            prompts: list[dict[str, Any]] = [{"text": t} for t in texts]
        else:
            ids = self.input_ids if self.is_batch else [self.input_ids]
            prompts = [{"input_ids": p} for p in ids]
        sp = self.sampling_params or GenerateSampling()
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)
        if len(sps) != len(prompts) or not prompts:
            raise ApiError(
                400,
                f"{len(sps)} sampling_params for {len(prompts)} prompts",
                "sampling_params",
                "invalid_value",
            )
        starts = self.logprob_start_len
        if not isinstance(starts, list):
            starts = [-1 if starts is None else starts] * len(prompts)
        elif len(starts) != len(prompts):
            msg = f"{len(starts)} logprob_start_len for {len(prompts)} prompts"
            raise ApiError(400, msg, "logprob_start_len", "invalid_value")
        rids = self._rids(len(prompts))
        loras = self._per_prompt("lora_path", len(prompts))
        salts = self._per_prompt("extra_key", len(prompts))
        subs: list[SubRequest] = []
        logprob, top = bool(self.return_logprob), self.top_logprobs_num or 0
        for i, (prompt, p, start) in enumerate(zip(prompts, sps, starts, strict=True)):
            for sub in fan_out([prompt], p.to_dict(), p.n, logprob, top, start):
                sub.index, sub.prompt_index, sub.rid = len(subs), i, rids[i]
                sub.priority, sub.lora_name, sub.cache_salt = self.priority, loras[i], salts[i]
                sub.return_text_in_logprobs = bool(self.return_text_in_logprobs)
                subs.append(sub)
        return subs

    def _per_prompt(self, name: str, num_prompts: int) -> list[Any]:
        """Field `name` of each prompt: one value for all, or a list of one per prompt."""
        value = getattr(self, name)
        values = value if isinstance(value, list) else [value] * num_prompts
        if len(values) != num_prompts:
            msg = f"{len(values)} {name} for {num_prompts} prompts"
            raise ApiError(400, msg, name, "invalid_value")
        return values

    def _rids(self, num_prompts: int) -> list[str | None]:
        """The client's rid of each prompt: a string for one prompt, a list for a batch."""
        rid = self.rid
        if rid is None:
            return [None] * num_prompts
        if isinstance(rid, str) == self.is_batch or (
            isinstance(rid, list) and len(rid) != num_prompts
        ):
            msg = "rid must be a string for one prompt, or a list of one rid per prompt"
            raise ApiError(400, msg, "rid", "invalid_value")
        rids = [rid] if isinstance(rid, str) else rid
        if len(set(rids)) != len(rids):
            raise ApiError(400, "rid has duplicates", "rid", "invalid_value")
        return list(rids)
