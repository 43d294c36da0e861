"""The offline engine's pooling calls: `encode` (SGLang's `Engine.encode`: embeddings, or a
classifier's logits) and `score` (vLLM's `LLM.score`: a relevance score per text pair, as
`/v1/score` answers it on the router)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.sampling.sampling_params import SamplingParams


class PoolingCalls:
    """Mixed into `Engine` (engine/engine.py), whose scheduler and tokenizer it uses."""

    args: Any
    scheduler: Any
    tokenizer: Any
    _rids: Any
    _input_ids: Any
    _run_until: Any

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        lora_path: str | None = None,
        token_type_ids: list[list[int] | None] | None = None,
        normalize: bool | None = None,
    ) -> dict | list[dict]:
        """An embedding model's embeddings (SGLang's `Engine.encode`), for one prompt (a dict)
        or a batch (a list): `{"embedding": [floats], "meta_info": {"id", "prompt_tokens",
        "cached_tokens"}}`, each embedding pooled as `pooling_type` says and L2-normalised; a
        sequence classifier's raw logits (one per label) in `embedding` (as SGLang's).
        `token_type_ids`: per prompt of `input_ids`, its token types (a BERT pair's).
        `normalize` False: the pooled states as they are (vLLM's pooling `normalize`)."""
        if not self.args.is_embedding:
            raise ValueError("encode: this engine serves a generative model (is_embedding off)")
        single, prompts_ids = self._input_ids(prompt, input_ids)
        rids = [f"offline-{next(self._rids)}" for _ in prompts_ids]
        types = token_type_ids or [None] * len(prompts_ids)
        if len(types) != len(prompts_ids):
            raise ValueError(f"encode: token_type_ids for {len(types)} of {len(rids)} prompts")
        for rid, ids, t in zip(rids, prompts_ids, types):
            params = SamplingParams(max_new_tokens=0, normalize_embedding=normalize).normalize()
            self.scheduler.add_request(rid, ids, params, lora_name=lora_path, token_type_ids=t)
        finished = {e.rid: e.req for e in self._run_until(set(rids)) if e.finished_reason}
        outs = []
        for rid in rids:
            req = finished[rid]
            meta = {"id": rid, "prompt_tokens": len(req.origin_input_ids),
                    "cached_tokens": req.cached_tokens}  # fmt: skip
            outs.append({"embedding": req.embedding.embedding().tolist(), "meta_info": meta})
        return outs[0] if single else outs

    def score(self, text_1: str | list[str], text_2: str | list[str]) -> list[float]:
        """Each pair's relevance score (vLLM's `LLM.score`): `text_1` one text for every
        `text_2`, or as many. A cross-encoder (a classifier of one label) runs each pair as
        one prompt, joined as its tokenizer joins pairs, and scores it by the logit's sigmoid;
        an embedding model embeds each text once and scores a pair by cosine similarity."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(first) == 1:
            first = first * len(second)
        if not second or len(first) != len(second):
            raise ValueError(f"score: {len(first)} text_1 for {len(second)} text_2")
        if self.tokenizer is None:
            raise ValueError("score: the engine was started with skip_tokenizer_init")
        labels = self.scheduler.model_runner.model_config.labels
        if labels:
            if len(labels) != 1:
                raise ValueError(f"score: a cross-encoder has one label; this has {len(labels)}")
            pairs = [self.tokenizer(a, text_pair=b, return_token_type_ids=True)
                     for a, b in zip(first, second)]  # fmt: skip
            ids = [p["input_ids"] for p in pairs]
            types = [p.get("token_type_ids") for p in pairs]
            outs = self.encode(input_ids=ids, token_type_ids=types)
            logits = torch.tensor([o["embedding"][0] for o in outs])
            return torch.sigmoid(logits.double()).tolist()
        texts = list(dict.fromkeys(first + second))  # each embedded once
        vectors = torch.tensor([o["embedding"] for o in self.encode(prompt=texts)]).double()
        row = {t: i for i, t in enumerate(texts)}
        a = vectors[[row[t] for t in first]]
        b = vectors[[row[t] for t in second]]
        return F.cosine_similarity(a, b, dim=-1).tolist()
