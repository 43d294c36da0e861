"""Another checkpoint's weights into a running engine (SGLang's `update_weights_from_disk`),
against transformers on each checkpoint: after an update the engine generates the new
weights' greedy tokens, with nothing of the old weights' K/V reused from the prefix cache,
with and without the overlap loop (its forward thread and its device process), with LoRA
adapters (applied over the new weights) and over an FP8 checkpoint; a checkpoint of another
model is refused before anything changes, and one that fails while being copied is undone."""

from __future__ import annotations

import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

import engine.weight_update as weight_update
from engine.engine import Engine
from tests.factories import (
    SCHEDULER_LOOPS,
    assert_engine_clean,
    hf_greedy,
    lora_greedy,
    mixed_prompts,
    tiny_fp8_model,
    tiny_lora,
    tiny_model,
)

NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
A, B = tiny_model("llama"), tiny_model("llama", seed=1)
PROMPT = mixed_prompts(500, n=1, max_len=40, seed=2)[0]


def greedy(eng: Engine, **kw: object) -> dict:
    return eng.generate(input_ids=PROMPT, sampling_params=GREEDY, **kw)


@SCHEDULER_LOOPS
def test_updated_weights_match_transformers(kw: dict) -> None:
    eng = Engine(model_path=A, max_total_tokens=2048, **kw)
    try:
        before = greedy(eng)
        assert greedy(eng)["meta_info"]["cached_tokens"] >= len(PROMPT) - 1
        assert before["meta_info"]["weight_version"] == "default"
        eng.update_weights_from_disk(B, weight_version="b-1")
        after = greedy(eng)
        assert after["meta_info"]["cached_tokens"] == 0  # the old weights' K/V are gone
        assert after["meta_info"]["weight_version"] == "b-1"
        eng.update_weights_from_disk(A)
        back = greedy(eng)
        assert eng.scheduler.weights_path == A
        assert_engine_clean(eng)
    finally:
        eng.shutdown()
    assert before["output_ids"] == back["output_ids"] == hf_greedy(A, PROMPT, NEW)
    assert after["output_ids"] == hf_greedy(B, PROMPT, NEW) != before["output_ids"]


def test_lora_adapters_apply_over_the_new_weights() -> None:
    adapter = tiny_lora(A, 1, 8)
    eng = Engine(model_path=A, lora_paths=(f"a={adapter}",), max_total_tokens=2048,
                 disable_overlap_schedule=True)  # fmt: skip
    try:
        eng.update_weights_from_disk(B)
        with_adapter, base = greedy(eng, lora_path="a"), greedy(eng)
    finally:
        eng.shutdown()
    assert with_adapter["output_ids"] == lora_greedy(B, adapter, PROMPT, NEW)
    assert base["output_ids"] == hf_greedy(B, PROMPT, NEW)


def test_fp8_checkpoint_updates_and_quantizing_on_load_is_refused() -> None:
    fp8 = tiny_fp8_model("llama")
    eng = Engine(model_path=fp8, max_total_tokens=2048, disable_overlap_schedule=True)
    try:
        before = greedy(eng)["output_ids"]
        with pytest.raises(ValueError, match="quantization None; the served model's is fp8"):
            eng.update_weights_from_disk(A)
        eng.update_weights_from_disk(fp8)  # (its own weights again: the FP8 path loads)
        assert greedy(eng)["output_ids"] == before
    finally:
        eng.shutdown()
    eng = Engine(model_path=A, quantization="fp8", max_total_tokens=2048,
                 disable_overlap_schedule=True)  # fmt: skip
    try:
        with pytest.raises(ValueError, match="quantized to FP8 as it loaded"):
            eng.update_weights_from_disk(B)
    finally:
        eng.shutdown()


def _without_one_tensor(tmp_path) -> str:
    out = tmp_path / "lacking"
    shutil.copytree(B, out)
    (file,) = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    tensors = load_file(out / file)
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, out / file)
    return str(out)


@pytest.mark.parametrize("kw", [dict(disable_overlap_schedule=True),
                                dict(cpu_overlap_executor="process")],
                         ids=["no-overlap", "process"])  # fmt: skip
def test_what_does_not_fit_is_refused_and_changes_nothing(kw: dict, tmp_path) -> None:
    eng = Engine(model_path=A, max_total_tokens=2048, **kw)
    try:
        want = greedy(eng)["output_ids"]
        cases = [
            (tiny_model("qwen3"), r"is a \['Qwen3ForCausalLM'\] checkpoint"),
            (tiny_model("llama", preset="small"), "does not fit the served model.*shape"),
            (_without_one_tensor(tmp_path), "lacks 1 weight"),
            (str(tmp_path / "nothing"), "no config.json"),
        ]
        for path, why in cases:
            with pytest.raises(ValueError, match=why):
                eng.update_weights_from_disk(path)
            assert greedy(eng)["output_ids"] == want, path
        eng.scheduler.add_request("busy", PROMPT, eng._params(GREEDY, 1, {})[0])
        eng.scheduler.step()  # (its K/V are the old weights'; a waiting one's would be new)
        with pytest.raises(ValueError, match="requests are running"):
            eng.update_weights_from_disk(B)
        eng.scheduler.abort_request("busy")
        while eng.scheduler.has_work():
            eng.scheduler.step()
        assert eng.scheduler.weights_path == A
        assert_engine_clean(eng)
    finally:
        eng.shutdown()


def test_a_failure_while_copying_reloads_the_old_weights(monkeypatch) -> None:
    real = weight_update.iter_safetensors

    def broken(path: str, names=None):
        for i, item in enumerate(real(path, names)):
            if path == B and i == 5:
                raise OSError("disk gone")
            yield item

    monkeypatch.setattr(weight_update, "iter_safetensors", broken)
    eng = Engine(model_path=A, max_total_tokens=2048, disable_overlap_schedule=True)
    try:
        want = greedy(eng)["output_ids"]
        with pytest.raises(RuntimeError, match="disk gone.*previous weights were reloaded"):
            eng.update_weights_from_disk(B)
        assert greedy(eng)["output_ids"] == want == hf_greedy(A, PROMPT, NEW)
        assert eng.scheduler.weights_path == A
    finally:
        eng.shutdown()
