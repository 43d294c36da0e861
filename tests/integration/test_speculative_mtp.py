"""MTP speculative decoding: a DeepSeek-V3 or GLM-4.5 model drafting with its own
multi-token-prediction layer (engine/models/mtp.py; SGLang's `--speculative-algorithm EAGLE`
/ `NEXTN` on such a model). The tokens are plain decoding's whatever the layer drafts; every
draft is what transformers' decoder layer, fed the layer's inputs, drafts from the model's
hidden states (float64); a layer derived from a near-bigram model has most drafts accepted;
only the layer's tensors are read; bad configurations are refused."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from engine.engine import Engine
from tests.factories import mixed_prompts, tiny_model
from tests.integration.test_speculative_eagle import drafted_chains, graph_run, spy_proposals

PLAIN = {"disable_overlap_schedule": True}
ARCHS = ("deepseek_v3", "glm4_moe")
K = 3


def mtp_model(arch: str, derived: bool = False) -> str:
    """A tiny `arch` model with one MTP layer (random, or derived: services/tiny_mtp.py),
    built once."""
    from services.tiny_mtp import add_mtp_layer

    base = tiny_model(arch)
    out = base + ("-mtp-derived" if derived else "-mtp")
    if not os.path.exists(os.path.join(out, "config.json")):
        tmp = out + f".{os.getpid()}"
        shutil.copytree(base, tmp)
        add_mtp_layer(tmp, derived=derived)
        os.replace(tmp, out)
    return out


def _spec(k: int = K, **kw) -> dict:
    # (SGLang's name; the draft is the model's own folder)
    return {"speculative_algorithm": "nextn", "speculative_num_draft_tokens": k, **kw}


def _tree(nodes: int = 6, topk: int = 2, steps: int = 3) -> dict:
    return _spec(nodes, speculative_eagle_topk=topk, speculative_num_steps=steps)


SHAPES = {"chain": _spec, "tree": _tree}


def _prompts(n: int = 5, seed: int = 0) -> list[list[int]]:
    return mixed_prompts(1000, n=n, seed=seed, max_len=80)


def _run(path: str, prompts, params, **kw):
    from tests.integration.test_speculative_draft_model import _run as run_checked

    outs, stats = run_checked(path, prompts, params, **PLAIN, **kw)
    return [o["output_ids"] for o in outs], stats


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_plain(arch: str, shape: str) -> None:
    """(a random layer: most drafts rejected; page size 4 and chunked prefills)"""
    path = mtp_model(arch)
    prompts = _prompts()
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    kw = {"page_size": 4, "chunked_prefill_size": 32}
    want, _ = _run(path, prompts, params, **kw)
    got, stats = _run(path, prompts, params, **SHAPES[shape](), **kw)
    assert got == want
    assert stats["spec_draft_tokens"] > 0, stats


@pytest.mark.parametrize("arch", ARCHS)
def test_derived_layer_is_mostly_accepted(arch: str) -> None:
    """A near-bigram model's derived MTP layer (services/tiny_mtp.py) drafts its next token
    but one: most drafts are accepted, chains and trees, and the tokens are plain
    decoding's; sampled with a seed and penalties, the tokens are plain decoding's too."""
    path = mtp_model(arch, derived=True)
    prompts = _prompts()
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    want, _ = _run(path, prompts, params)
    for shape, least in (("chain", 2.8), ("tree", 3.0)):
        got, stats = _run(path, prompts, params, **SHAPES[shape]())
        assert got == want, shape
        # (when written: deepseek_v3 3.42 / 3.65, glm4_moe 3.45 / 3.68 of at most 4)
        assert stats["spec_accept_length"] > least, (shape, stats)
    sampled = [{"temperature": 0.8, "sampling_seed": 7 + i, "max_new_tokens": 16,
                "ignore_eos": True, "frequency_penalty": 0.3}
               for i in range(len(prompts))]  # fmt: skip
    want, _ = _run(path, prompts, sampled)
    got, _ = _run(path, prompts, sampled, **_spec())
    assert got == want


@pytest.mark.parametrize("arch", ARCHS)
def test_drafts_are_transformers_layers(arch: str) -> None:
    """Every request's drafts of every step equal the chain of transformers' decoder layer fed
    the MTP layer's inputs (services/tiny_mtp.MtpReference), from the model's final normed
    hidden states of the request's tokens (transformers', float64), each later draft reading
    the layer's own output hidden state (SGLang's chaining)."""
    from transformers import AutoModelForCausalLM

    from services.tiny_mtp import MtpReference

    path = mtp_model(arch)
    prompts = _prompts(3, seed=2)
    params = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
    kw = {"dtype": torch.float64, "page_size": 4, "chunked_prefill_size": 32}
    proposals = drafted_chains(path, _spec(), prompts, params, **kw)
    assert len(proposals) > 10
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    ref = MtpReference(path)
    with torch.no_grad():
        for tokens, drafts in proposals:
            seq = torch.from_numpy(np.asarray(tokens))
            hidden = model(seq[None], output_hidden_states=True).hidden_states[-1][0]
            n = len(seq) - 1  # layer positions 0 .. L - 2: tokens 1 .. L - 1, hidden 0 .. L - 2
            ids_in, states, want = seq[1:], hidden[:n], []
            for _ in drafts:
                logits, out = ref(ids_in, states)
                token = int(logits[-1].argmax())
                want.append(token)
                ids_in = torch.cat([ids_in, torch.tensor([token])])
                states = torch.cat([states, out[-1:]])
            assert drafts == want, (len(tokens), drafts, want)


def test_graphs_replay_the_eager_drafts() -> None:
    """With the model's and the layer's graphs (the CPU's eager double), the layer's decode
    and catch-up forwards replay its graphs, and drafts and tokens are the eager run's
    (MLA on the Triton backend)."""
    path = mtp_model("deepseek_v3", derived=True)
    prompts = [p[:20] for p in _prompts(3, seed=4)]
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in (9, 6, 3)]
    kw = {"cuda_graph_bs": (1, 2, 4), "max_total_tokens": 1024, "attention_backend": "triton"}
    want, want_drafts, _, _ = graph_run(path, _spec(), prompts, params, False, **kw)
    got, got_drafts, _, replays = graph_run(path, _spec(), prompts, params, True, **kw)
    assert got == want
    assert got_drafts == want_drafts
    for kind in ("head graph_runner", "head verify_graph_runner", "model verify_graph_runner"):
        assert replays[kind] > 0, replays


def test_only_the_layers_tensors_are_read_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head reads the MTP layer's tensors and no others (not its copies of the embedding
    and lm_head: the model's are used), and its weights are counted as those tensors."""
    import engine.loader as loader
    from engine.config import EngineArgs
    from engine.speculative.eagle import head_model_config

    path = mtp_model("glm4_moe")
    read: list[list[str]] = []
    orig = loader.iter_safetensors

    def spy(p, names=None):
        got = []
        read.append(got)
        for name, tensor in orig(p, names):
            got.append(name)
            yield name, tensor

    monkeypatch.setattr(loader, "iter_safetensors", spy)
    with Engine(model_path=path, **PLAIN, **_spec()) as engine:
        head = engine.scheduler.drafter.runner
        assert type(head.model).__name__ == "Glm4MoeForCausalLMNextN"
        assert head.model_config.num_layers == 1
        assert head.kv_pool.num_layers == 1
    index = json.load(open(os.path.join(path, "config.json")))["num_hidden_layers"]
    prefix = f"model.layers.{index}."
    head_read = read[1]  # (the model's, then the head's)
    assert head_read and all(n.startswith(prefix) for n in head_read)
    assert not any(("embed_tokens" in n or "shared_head.head" in n) for n in head_read)
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        want = sum(f.get_tensor(n).nbytes for n in head_read)
    args = EngineArgs(model_path=path, **_spec())
    assert loader.checkpoint_bytes(head_model_config(args)) == want


def test_configurations() -> None:
    """EAGLE / NEXTN / vLLM's MTP methods on a model with an MTP layer draft with it (the
    model's own folder); refused with the reason where the checkpoint has none (a tiny
    DeepSeek-V3 config declares one by default: transformers' default), for a model family
    without, and for a draft 'model' with vLLM's MTP methods."""
    from engine.config import EngineArgs
    from engine.speculative import from_vllm_config

    path = mtp_model("deepseek_v3")
    for algo in ("EAGLE", "NEXTN", "mtp"):
        args = EngineArgs(model_path=path, speculative_algorithm=algo)
        assert args.speculative_algorithm == "eagle"
        assert args.speculative_draft_model_path == path
    fields = from_vllm_config({"method": "deepseek_mtp", "num_speculative_tokens": 2})
    assert fields == {"speculative_algorithm": "eagle", "speculative_num_draft_tokens": 2}
    assert EngineArgs(model_path=path, **fields).speculative_draft_model_path == path
    with pytest.raises(ValueError, match="MTP layers: no 'model'"):
        from_vllm_config({"method": "mtp", "model": path})
    stripped = tiny_model("deepseek_v3")  # (config: num_nextn_predict_layers 1; no tensors)
    assert json.load(open(os.path.join(stripped, "config.json")))["num_nextn_predict_layers"]
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        EngineArgs(model_path=stripped, speculative_algorithm="nextn")
    with pytest.raises(ValueError, match="without a multi-token-prediction layer"):
        Engine(model_path=stripped, **PLAIN, **_spec(), speculative_draft_model_path=stripped)
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        EngineArgs(model_path=tiny_model("llama"), speculative_algorithm="nextn")


def test_over_two_ranks() -> None:
    """DeepSeek-V3 over two ranks (its heads and experts split), the MTP layer whole on rank
    0's device with the model's embedding and lm_head read whole from the checkpoint: the
    derived layer's drafts are accepted as on one rank, and the tokens are plain decoding's."""
    path = mtp_model("deepseek_v3", derived=True)
    prompts = _prompts(4, seed=7)
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    want, _ = _run(path, prompts, params)
    _, one = _run(path, prompts, params, **_spec())
    with Engine(model_path=path, **PLAIN, tp_size=2, **_spec()) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.get_stats()
        assert engine.scheduler.drafter.runner.tp.size == 1
    assert [o["output_ids"] for o in outs] == want
    assert stats["spec_accept_length"] == pytest.approx(one["spec_accept_length"]), (stats, one)


def test_hicache_loads_bring_the_hidden_states_the_layer_reads() -> None:
    """With the hierarchical cache, documents evicted to host memory come back with their
    kept hidden states: a random layer (whose drafts depend on them) drafts what it drafts
    with a plain radix cache, and the tokens are the same."""
    from tests.integration.test_hicache import GREEDY, documents

    path = mtp_model("deepseek_v3")
    docs = documents(6, vocab=1000)
    prompts = [doc + [10 + r, 11 + i, 12] for r in range(2) for i, doc in enumerate(docs)]
    kw = {"max_total_tokens": 640, "chunked_prefill_size": 128}

    def rounds(hicache: bool):
        drafts: list = []
        with Engine(model_path=path, **PLAIN, **kw, enable_hierarchical_cache=hicache,
                    hicache_ratio=4.0, **_spec()) as engine:  # fmt: skip
            spy_proposals(engine.scheduler.drafter, drafts)
            outs = [engine.generate(input_ids=[p], sampling_params=GREEDY)[0]["output_ids"]
                    for p in prompts]  # fmt: skip
            return outs, drafts, engine.get_stats()

    want, want_drafts, _ = rounds(False)
    got, got_drafts, stats = rounds(True)
    assert stats["hicache_loaded_tokens"] >= 5 * 200, stats
    assert got == want
    assert got_drafts == want_drafts


def test_fp8_checkpoint(tmp_path) -> None:
    """An FP8 checkpoint (the MTP layer quantized with the rest, as DeepSeek-V3's): the
    layer's projections run in FP8, and the tokens are the FP8 model's plain decoding's."""
    from engine.layers.fp8 import Fp8Linear
    from services.tiny_fp8 import quantize_checkpoint

    path = str(tmp_path / "fp8")
    shutil.copytree(mtp_model("deepseek_v3", derived=True), path)
    quantize_checkpoint(path)
    prompts = _prompts(4)
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    want, _ = _run(path, prompts, params)
    with Engine(model_path=path, **PLAIN, **_spec()) as engine:
        layer = engine.scheduler.drafter.runner.model.model.layers[0]
        assert isinstance(layer.self_attn.o_proj, Fp8Linear)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.get_stats()
    assert [o["output_ids"] for o in outs] == want
    assert stats["spec_accept_length"] > 2.5, stats


def test_the_layer_follows_the_models_weight_updates(tmp_path) -> None:
    """The MTP layer is part of the model's checkpoint, so it follows the model's weight
    updates (an RL trainer's): from disk (a checkpoint of the same model with a random
    layer: drafts stop being accepted), from tensors (the derived layer's sent back: they
    are again), read back by name; a checkpoint whose layer does not fit changes nothing."""
    from safetensors.torch import load_file, save_file

    from services.tiny_mtp import add_mtp_layer

    derived = mtp_model("glm4_moe", derived=True)
    other = str(tmp_path / "random-layer")  # (the same model, a random layer)
    shutil.copytree(tiny_model("glm4_moe"), other)
    add_mtp_layer(other, derived=True, random_layer=True)
    index = json.load(open(os.path.join(derived, "config.json")))["num_hidden_layers"]
    prefix = f"model.layers.{index}."
    mine = {n: t for n, t in load_file(os.path.join(derived, "model.safetensors")).items()
            if n.startswith(prefix) and "embed_tokens" not in n and "shared_head.head" not in n}
    bad = str(tmp_path / "bad-layer")  # (a layer whose eh_proj has the wrong shape)
    shutil.copytree(derived, bad)
    w = load_file(os.path.join(bad, "model.safetensors"))
    w[prefix + "eh_proj.weight"] = w[prefix + "eh_proj.weight"][:, :-1].contiguous()
    save_file(w, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})

    prompts = _prompts(4)
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    want, _ = _run(derived, prompts, params)
    name = prefix + "eh_proj.weight"
    with Engine(model_path=derived, **PLAIN, **_spec()) as engine:
        head = engine.scheduler.drafter.runner

        def accepted() -> float:
            """The fraction of this run's drafts accepted (tokens: plain decoding's)."""
            before = engine.get_stats()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            assert [o["output_ids"] for o in outs] == want
            after = engine.get_stats()
            drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            return (after["spec_accepted_tokens"] - before["spec_accepted_tokens"]) / drafts

        def served(tensor: torch.Tensor) -> bool:
            return torch.equal(head.model.model.eh_proj.weight.cpu(), tensor) and (
                engine.get_weights_by_name(name, 5) == pytest.approx(tensor.flatten()[:5]))

        assert accepted() > 0.6
        with pytest.raises(ValueError, match="does not fit"):
            engine.update_weights_from_disk(bad)
        assert served(mine[name])
        engine.update_weights_from_disk(other)
        assert served(load_file(os.path.join(other, "model.safetensors"))[name])
        assert accepted() < 0.1
        engine.update_weights_from_tensor(list(mine.items()))
        assert served(mine[name])
        assert accepted() > 0.6


def test_a_folder_of_the_layer_alone(tmp_path) -> None:
    """A folder exported with the MTP layer alone (SGLang's export script's layout:
    `architectures` DeepseekV3ForCausalLMNextN, `num_hidden_layers` 1, the layer as
    `model.layers.0` in a shard of its own with an index, no embedding or lm_head copies) as
    the draft path drafts exactly what the model's own layer does."""
    from safetensors.torch import load_file, save_file

    path = mtp_model("deepseek_v3", derived=True)
    config = json.load(open(os.path.join(path, "config.json")))
    prefix = f"model.layers.{config['num_hidden_layers']}."
    out = tmp_path / "nextn"
    out.mkdir()
    layer = {n.replace(prefix, "model.layers.0."): t
             for n, t in load_file(os.path.join(path, "model.safetensors")).items()
             if n.startswith(prefix) and "embed_tokens" not in n and "shared_head.head" not in n}
    save_file(layer, str(out / "nextn_layer_parameters.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "nextn_layer_parameters.safetensors" for n in layer}}))
    config.update(num_hidden_layers=1, architectures=["DeepseekV3ForCausalLMNextN"])
    (out / "config.json").write_text(json.dumps(config))
    prompts = _prompts(4)
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    want, _ = _run(path, prompts, params)
    drafts: dict[str, list] = {"own": [], "exported": []}
    for key, extra in (("own", {}), ("exported", {"speculative_draft_model_path": str(out)})):
        with Engine(model_path=path, **PLAIN, **_spec(**extra)) as engine:
            spy_proposals(engine.scheduler.drafter, drafts[key])
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            assert [o["output_ids"] for o in outs] == want
    assert drafts["exported"] == drafts["own"]
    assert sum(len(d) for step in drafts["own"] for d in step) > 0


def test_token_map(tmp_path) -> None:
    """`speculative_token_map` (FR-Spec) with an MTP layer: a map of every token in reverse
    order drafts what the layer drafts without one, a subset drafts from it only, and the
    tokens are plain decoding's."""
    path = mtp_model("glm4_moe", derived=True)
    prompts = _prompts(4, seed=8)
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    everything, subset = tmp_path / "all.pt", tmp_path / "subset.json"
    torch.save(torch.arange(vocab - 1, -1, -1), everything)
    subset.write_text(str(list(range(0, vocab, 3))))
    want, _ = _run(path, prompts, params)

    def drafted(**kw) -> list:
        drafts: list = []
        with Engine(model_path=path, **PLAIN, **_spec(**kw)) as engine:
            spy_proposals(engine.scheduler.drafter, drafts)
            outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == want
        return drafts

    base = drafted()
    assert drafted(speculative_token_map=str(everything)) == base
    made = {t for step in drafted(speculative_token_map=str(subset)) for d in step for t in d}
    assert made and all(t % 3 == 0 for t in made)
