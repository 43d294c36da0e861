"""Served weights read back by checkpoint name (SGLang's `Engine.get_weights_by_name`;
engine/weight_read.py), against the checkpoint's own tensors: q, k and v (rows of one fused
projection), gate and up, plain weights and norms of a Llama, GPT-2's Conv1D weights (stored
transposed), an MoE expert's slice of the stacked experts, and a parameter by its own name; in
every loop (the device process answers); after a partial tensor update the new values, the rest
unchanged; what is not a weight of its own (a tied head), a weight quantized to FP8 as it
loaded, an unknown name and released weights are refused with the reason."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.engine import Engine
from tests.factories import SCHEDULER_LOOPS, tiny_fp8_model, tiny_model, tiny_w8a8_model

A, B = tiny_model("llama"), tiny_model("llama", seed=1)


def checkpoint(path: str) -> dict[str, torch.Tensor]:
    import glob

    out: dict[str, torch.Tensor] = {}
    for file in glob.glob(f"{path}/*.safetensors"):
        out.update(load_file(file))
    return out


def served(eng: Engine, name: str, n: int = 10**9) -> torch.Tensor:
    return torch.tensor(eng.get_weights_by_name(name, truncate_size=n))


@SCHEDULER_LOOPS
def test_llama_weights_read_back_as_the_checkpoint_has_them(kw: dict) -> None:
    tensors = checkpoint(A)
    names = [n for n in tensors if n.startswith("model.layers.0.")]
    names += ["model.norm.weight", "model.embed_tokens.weight"]
    assert {n.rsplit(".", 2)[-2] for n in names} >= {"q_proj", "k_proj", "v_proj", "gate_proj",
                                                      "up_proj", "down_proj"}  # fmt: skip
    with Engine(model_path=A, **kw) as eng:
        for name in names:
            assert torch.equal(served(eng, name), tensors[name].flatten().float()), name
        assert served(eng, "model.layers.0.self_attn.q_proj.weight", 7).numel() == 7
        qkv = served(eng, "model.layers.0.self_attn.qkv_proj.weight")  # (a parameter's name)
        q = tensors["model.layers.0.self_attn.q_proj.weight"].flatten()
        assert torch.equal(qkv[: q.numel()], q.float())


def test_a_partial_update_reads_back_new_and_old() -> None:
    a, b = checkpoint(A), checkpoint(B)
    k, q = "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    with Engine(model_path=A, disable_overlap_schedule=True) as eng:
        eng.update_weights_from_tensor([(k, b[k])])
        assert torch.equal(served(eng, k), b[k].flatten().float())
        assert torch.equal(served(eng, q), a[q].flatten().float())


@pytest.mark.parametrize("arch", ["gpt2", "mixtral", "qwen2_moe"])
def test_transposed_and_expert_weights_read_back(arch: str) -> None:
    path = tiny_model(arch)
    tensors = checkpoint(path)
    picks = [n for n in tensors if any(k in n for k in (".c_attn.", ".c_fc.", ".experts.1.",
                                                         ".shared_expert."))]
    assert picks
    with Engine(model_path=path, disable_overlap_schedule=True) as eng:
        for name in picks:
            assert torch.equal(served(eng, name), tensors[name].flatten().float()), name


def test_what_cannot_be_read_is_refused() -> None:
    with Engine(model_path=A, disable_overlap_schedule=True) as eng:
        with pytest.raises(ValueError, match="no weight named 'model.nothing'"):
            eng.get_weights_by_name("model.nothing")
        eng.release_memory_occupation(["weights"])
        with pytest.raises(ValueError, match="the weights are released"):
            eng.get_weights_by_name("model.norm.weight")
        eng.resume_memory_occupation()
    with Engine(model_path=A, disable_overlap_schedule=True, quantization="fp8") as eng:
        with pytest.raises(ValueError, match="cannot be read back: the served weight is comp"):
            eng.get_weights_by_name("model.layers.0.self_attn.q_proj.weight")  # (quantized)
        assert len(eng.get_weights_by_name("model.norm.weight", 5)) == 5  # (kept 16-bit)
    layer = "model.layers.0.self_attn.q_proj"
    with Engine(model_path=tiny_fp8_model("llama"), disable_overlap_schedule=True) as eng:
        for part in ("weight", "weight_scale_inv"):  # (before: a pairing error of the loader)
            with pytest.raises(ValueError, match="cannot be read back: it is a part of a quan"):
                eng.get_weights_by_name(f"{layer}.{part}")
        assert len(eng.get_weights_by_name("model.norm.weight", 5)) == 5
    with Engine(model_path=tiny_w8a8_model("llama"), disable_overlap_schedule=True) as eng:
        for part in ("weight", "weight_scale"):  # (the int8 values: the pairing error too)
            with pytest.raises(ValueError, match="cannot be read back: it is a part of a quan"):
                eng.get_weights_by_name(f"{layer}.{part}")


def test_a_tied_head_is_not_a_weight_of_its_own(tmp_path) -> None:
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(tiny_model("gpt2"), tmp_path / "m")  # (tied: wte is the head)
    tensors = checkpoint(str(tmp_path / "m"))
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()  # (as some save it)
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with Engine(model_path=str(tmp_path / "m"), disable_overlap_schedule=True) as eng:
        with pytest.raises(ValueError, match="'lm_head.weight' is not a weight of its own"):
            eng.get_weights_by_name("lm_head.weight")
