"""A worker started with `--speculative-algorithm ngram` (or `standalone` with a draft model,
`eagle` with an EAGLE head, chained or as trees, or `nextn` with a DeepSeek-V3's own MTP
layer) serves through the streams: the tokens of plain decoding, streamed several per step
when drafts are accepted, and its heartbeat reports the accept length."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from shared.messages import WorkerLoadMsg
from tests.factories import tiny_model
from tests.system.procs import WORKER_TEST_ARGS, start_stack, wait_until
from tests.system.stream_client import StreamClient

pytest_plugins = ["tests.redis_fixtures"]

SPEC_ARGS = (*WORKER_TEST_ARGS, "--speculative-algorithm", "ngram",
             "--speculative-num-draft-tokens", "4")  # fmt: skip
PROMPTS = ["The capital of France is", "def fibonacci(n):", "a b a b a b a b"]
# few allowed tokens: outputs repeat, drafts are found and partly accepted
PARAMS = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True,
          "allowed_token_ids": [11, 12, 13]}  # fmt: skip


@pytest.mark.parametrize("algorithm", ["ngram", "standalone", "eagle", "eagle_tree", "mtp"])
def test_speculative_worker_streams_plain_decodings_tokens(
    redis_url: str, tmp_path, algorithm: str
) -> None:
    model = tiny_model("llama")
    args = SPEC_ARGS
    if algorithm == "standalone":  # a perturbed copy of the model drafts (part of it right)
        from tests.integration.test_speculative_draft_model import noisy_draft

        args = (*WORKER_TEST_ARGS, "--speculative-algorithm", "standalone",
                "--speculative-draft-model-path", noisy_draft(model),
                "--speculative-num-draft-tokens", "4")  # fmt: skip
    if algorithm == "eagle":  # a random head: right about a third of the time among 3 tokens
        # (SGLang's chain command: 3 steps of topk 1, num_draft_tokens counting the last)
        args = (*WORKER_TEST_ARGS, "--speculative-algorithm", "EAGLE",
                "--speculative-draft-model-path", _random_head(model),
                "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", "4")  # fmt: skip
    if algorithm == "eagle_tree":  # its trees: 6 nodes of 3 steps of topk 2
        args = (*WORKER_TEST_ARGS, "--speculative-algorithm", "EAGLE",
                "--speculative-draft-model-path", _random_head(model),
                "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                "--speculative-num-draft-tokens", "6")  # fmt: skip
    if algorithm == "mtp":  # a DeepSeek-V3's own random MTP layer (SGLang's NEXTN: no path)
        from tests.integration.test_speculative_mtp import mtp_model

        model = mtp_model("deepseek_v3")
        args = (*WORKER_TEST_ARGS, "--speculative-algorithm", "NEXTN",
                "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", "4")  # fmt: skip
    with Engine(model_path=model, disable_overlap_schedule=True) as engine:
        want = [o["output_ids"] for o in engine.generate(prompt=PROMPTS, sampling_params=PARAMS)]
    with start_stack(redis_url, model, str(tmp_path), worker_args=args, router=False) as st:
        st.wait_ready()
        client = StreamClient(st.bus, st.worker_id)
        rids = [client.request(text=p, sampling_params=PARAMS) for p in PROMPTS]
        results = client.wait(rids, timeout_s=120)
        for rid, ids in zip(rids, want, strict=True):
            r = results[rid]
            assert r.error is None, r.error
            assert r.output_ids == ids
            assert r.final.completion_tokens == 40
        key = f"{st.prefix}:hb:worker:{st.worker_id}"

        def accept_length() -> float:
            return WorkerLoadMsg.from_msg(st.bus.redis.get(key)).spec_accept_length

        wait_until(lambda: accept_length() > 1.0, 30.0, [st.worker], "the accept length")
        assert accept_length() < 5.0


def _random_head(model: str) -> str:
    import os

    from services.tiny_eagle import make_eagle_head

    out = model + "-eagle-random"
    if not os.path.exists(os.path.join(out, "config.json")):
        make_eagle_head(model, out)
    return out
