"""EAGLE / EAGLE-3 speculative decoding on a GPU with real CUDA graphs: the model's decode and
verify graphs write the hidden states the head reads (captured with them), the head's decode
forwards replay its own graphs (its hidden states through static buffers); greedy tokens equal
plain decoding's (float32, Triton), and the default backends (flashinfer prefill, Triton
decode) in bfloat16 run with every graph kind replayed."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu

from tests.factories import require_compiled_cuda  # noqa: E402

require_compiled_cuda()

from engine.cuda_graph_runner import CudaGraphRunner  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.speculative.verify_graphs import VerifyGraphRunner  # noqa: E402
from tests.factories import tiny_model  # noqa: E402

DRAFTS = 3


def _target(head_dim: int | None) -> str:
    """A tiny Llama of 6 layers (EAGLE-3 reads three distinct ones), built once."""
    from services.tiny_model import make_tiny_model

    tag = f"-hd{head_dim}" if head_dim else ""
    out = os.path.join(os.path.dirname(tiny_model("llama")), f"llama-eagle-gpu-6{tag}")
    if not os.path.exists(os.path.join(out, "config.json")):
        kw = {"head_dim": head_dim} if head_dim else {}
        make_tiny_model(out, "llama", num_layers=6, **kw)
    return out


def _head(target: str, kind: str) -> str:
    from services.tiny_eagle import make_eagle_head

    out = f"{target}-{kind}"
    if not os.path.exists(os.path.join(out, "config.json")):
        make_eagle_head(target, out, eagle3=kind == "eagle3",
                        draft_vocab=512 if kind == "eagle3" else None)  # fmt: skip
    return out


def _replays(monkeypatch) -> dict[str, list[int]]:
    """Batch sizes replayed, by graph runner: the head's decode graphs, the model's decode
    and verify graphs (told apart by the runner's model)."""
    seen: dict[str, list[int]] = {"head": [], "decode": [], "verify": []}
    for cls, name in ((CudaGraphRunner, "decode"), (VerifyGraphRunner, "verify")):
        replay = cls.replay

        def counting(self, fb, _replay=replay, _name=name):
            key = "head" if hasattr(self.model, "decode_hidden_width") else _name
            seen[key].append(fb.batch_size)
            return _replay(self, fb)

        monkeypatch.setattr(cls, "replay", counting)
    return seen


PROMPTS = [[5, 6, 7, 8] * 6, list(range(20, 41)), [9, 10, 11] * 5, [300, 301] * 4, [12] * 7]
PARAMS = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
          for n in (30, 24, 16, 20, 9)]  # fmt: skip


def _generate(path: str, **kw) -> list[list[int]]:
    engine = Engine(model_path=path, device="cuda", max_total_tokens=8192,
                    disable_overlap_schedule=True, cuda_graph_bs=(1, 2, 4, 8),
                    skip_tokenizer_init=True, **kw)  # fmt: skip
    outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    engine.shutdown()
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_tokens_equal_plain_decoding_with_graphs(kind, monkeypatch):
    path = _target(None)
    kw = {"dtype": "float32", "attention_backend": "triton"}
    want = _generate(path, **kw)
    seen = _replays(monkeypatch)
    got = _generate(path, **kw, speculative_algorithm=kind, speculative_draft_model_path=_head(
        path, kind), speculative_num_draft_tokens=DRAFTS)  # fmt: skip
    assert got == want
    assert seen["head"] and seen["verify"], {k: len(v) for k, v in seen.items()}


@pytest.mark.parametrize("topk", [1, 2])
def test_default_backends_in_bfloat16_replay_every_graph(monkeypatch, topk):
    """(topk 2: draft trees, whose verify steps the default backends put on Triton's extend
    kernel)"""
    path = _target(64)  # (flashinfer's kernels take head_dim 64, 128 or 256)
    seen = _replays(monkeypatch)
    tree = {"speculative_eagle_topk": 2, "speculative_num_steps": DRAFTS} if topk > 1 else {}
    got = _generate(path, dtype="bfloat16", speculative_algorithm="eagle3",
                    speculative_draft_model_path=_head(path, "eagle3"),
                    speculative_num_draft_tokens=2 * DRAFTS if tree else DRAFTS,
                    **tree)  # fmt: skip
    assert [len(g) for g in got] == [p["max_new_tokens"] for p in PARAMS]
    assert seen["head"] and seen["verify"], {k: len(v) for k, v in seen.items()}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_draft_trees_equal_plain_decoding(kind, monkeypatch):
    """Draft trees (topk 2, 6 nodes, 3 steps) on the GPU: the Triton extend kernel's tree
    mask compiled for sm_90, the accepted nodes' K/V and hidden rows moved on the device;
    float32 greedy tokens equal plain decoding's. The model's tree steps replay its verify
    graphs of trees (static masks), the head's catch-ups its verify graphs and its tree
    forwards its decode graphs."""
    path = _target(None)
    kw = {"dtype": "float32", "attention_backend": "triton"}
    want = _generate(path, **kw)
    seen = _replays(monkeypatch)
    got = _generate(path, **kw, speculative_algorithm=kind, speculative_draft_model_path=_head(
        path, kind), speculative_num_draft_tokens=6, speculative_eagle_topk=2,
        speculative_num_steps=3)  # fmt: skip
    assert got == want
    assert seen["head"] and seen["verify"], {k: len(v) for k, v in seen.items()}


def test_hicache_loads_bring_the_hidden_states_back():
    """EAGLE with the hierarchical cache on the GPU: documents evicted to (pinned) host memory
    come back with their kept hidden states through the asynchronous store and load paths;
    the rows the head reads for the second round equal the first round's (float32, Triton),
    and the tokens are a plain radix cache's."""
    import torch

    from tests.integration.test_hicache import GREEDY, documents

    path = _target(None)
    docs = documents(6, vocab=1000)

    def rounds(hicache: bool):
        engine = Engine(model_path=path, device="cuda", dtype="float32", max_total_tokens=640,
                        chunked_prefill_size=128, attention_backend="triton",
                        disable_overlap_schedule=True, skip_tokenizer_init=True,
                        enable_hierarchical_cache=hicache, hicache_ratio=4.0,
                        speculative_algorithm="eagle",
                        speculative_draft_model_path=_head(path, "eagle"),
                        speculative_num_draft_tokens=DRAFTS)  # fmt: skip
        sched, rows = engine.scheduler, {}
        orig = sched.drafter.propose

        def spy(reqs):
            for r in reqs:
                if r.rid not in rows:
                    table = sched.model_runner.req_to_token_pool.req_to_token
                    slots = table[r.req_pool_idx, : len(r.origin_input_ids) - 1].long()
                    rows[r.rid] = sched.model_runner.hidden_capture.rows(slots).cpu()
            return orig(reqs)

        sched.drafter.propose = spy
        outs, seen = [], []
        for _ in range(2):  # (the same prompts twice: the second from the host)
            for i, doc in enumerate(docs):
                out = engine.generate(input_ids=[doc + [10, 11 + i, 12]],
                                      sampling_params=GREEDY)[0]  # fmt: skip
                outs.append(out["output_ids"])
                seen.append(rows[out["meta_info"]["id"]])
        stats = engine.get_stats()
        engine.shutdown()
        return outs, seen, stats

    want, _, _ = rounds(False)
    got, seen, stats = rounds(True)
    assert got == want
    assert stats["hicache_loaded_tokens"] > 0, stats
    for first, second in zip(seen[:6], seen[6:], strict=True):
        torch.testing.assert_close(second, first, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_layers_draft_with_graphs(arch, monkeypatch):
    """A model's own MTP layer drafting on the GPU (`nextn`, float32, Triton: DeepSeek-V3's
    MLA and GLM-4.5's attention): chains and trees, greedy tokens equal plain decoding's with
    the head's and the model's verify graphs replayed; a derived layer (services/tiny_mtp.py)
    has most drafts accepted."""
    from tests.integration.test_speculative_mtp import mtp_model

    path = mtp_model(arch, derived=True)
    kw = {"dtype": "float32", "attention_backend": "triton"}
    want = _generate(path, **kw)
    for tree in ({}, {"speculative_eagle_topk": 2, "speculative_num_steps": DRAFTS}):
        seen = _replays(monkeypatch)
        engine = Engine(model_path=path, device="cuda", max_total_tokens=8192,
                        disable_overlap_schedule=True, cuda_graph_bs=(1, 2, 4, 8),
                        skip_tokenizer_init=True, speculative_algorithm="nextn",
                        speculative_num_draft_tokens=2 * DRAFTS if tree else DRAFTS,
                        **tree, **kw)  # fmt: skip
        outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
        stats = engine.get_stats()
        engine.shutdown()
        assert [o["output_ids"] for o in outs] == want, tree
        assert stats["spec_accept_length"] > 2.0, (tree, stats)
        assert seen["head"] and seen["verify"], {k: len(v) for k, v in seen.items()}
