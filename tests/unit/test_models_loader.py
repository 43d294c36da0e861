"""Loader and registry behaviour a user notices: clear errors on bad checkpoints, dtype casting,
older checkpoint layouts, unsupported architectures and rope types."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.forward_batch import ForwardMode
from engine.layers.rotary import RotaryEmbedding, compute_inv_freq, rope_parameters
from engine.loader import load_model
from engine.models import get_model_class, supported_architectures
from tests.unit.test_models import LLAMA_SHAPE, VOCAB, PagedHarness, save_random_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama"))
    save_random_model("llama", path)
    return path


def _rewrite(src: str, dst, edit) -> str:
    """Copy the model folder `src` to `dst` with its tensors passed through `edit(dict)`."""
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_text(open(f"{src}/{name}").read())
    tensors = load_file(f"{src}/model.safetensors")
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_missing_weight_is_named(llama_dir, tmp_path):
    path = _rewrite(llama_dir, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 weight.*layers\.1\.mlp\.gate_up_proj\.weight"):
        load_model(ModelConfig.from_pretrained(path), torch.float32)


def test_unexpected_weight_is_named(llama_dir, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)

    path = _rewrite(llama_dir, tmp_path, add)
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.self_attn\.extra"):
        load_model(ModelConfig.from_pretrained(path), torch.float32)


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_multi_token_prediction_layers_are_skipped(arch, tmp_path):
    """DeepSeek-V3 and GLM-4.5 checkpoints store `num_nextn_predict_layers` MTP layers after
    the decoder's (`model.layers.{num_hidden_layers}`: eh_proj, enorm, hnorm, its own
    attention and experts): left out, the same weights load; a layer past them is still an
    error."""
    source = tmp_path / "source"
    save_random_model(arch, str(source))
    config = json.loads((source / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (source / "config.json").write_text(json.dumps(config))
    first = config["num_hidden_layers"]
    plain = load_model(ModelConfig.from_pretrained(str(source)), torch.float32).state_dict()

    def mtp(index: int):
        def add(t):
            for name in [n for n in t if n.startswith(f"model.layers.{first - 1}.")]:
                t[name.replace(f"layers.{first - 1}.", f"layers.{index}.")] = t[name].clone()
            hidden = config["hidden_size"]
            t[f"model.layers.{index}.eh_proj.weight"] = torch.ones(hidden, 2 * hidden)
            t[f"model.layers.{index}.enorm.weight"] = torch.ones(hidden)

        return add

    (tmp_path / "mtp").mkdir()
    (tmp_path / "beyond").mkdir()
    path = _rewrite(str(source), tmp_path / "mtp", mtp(first))
    loaded = load_model(ModelConfig.from_pretrained(path), torch.float32).state_dict()
    assert loaded.keys() == plain.keys()
    assert all(torch.equal(loaded[name], plain[name]) for name in plain)
    path = _rewrite(str(source), tmp_path / "beyond", mtp(first + 1))
    with pytest.raises(ValueError, match=rf"unexpected weight 'model\.layers\.{first + 1}\."):
        load_model(ModelConfig.from_pretrained(path), torch.float32)


def test_ernie_moe_mtp_block_is_skipped(tmp_path):
    """ERNIE-4.5-21B-A3B's checkpoint stores its MTP block as `model.mtp_*` tensors."""
    source = tmp_path / "source"
    save_random_model("ernie4_5_moe", str(source))
    plain = load_model(ModelConfig.from_pretrained(str(source)), torch.float32).state_dict()

    def add(t):
        hidden = LLAMA_SHAPE["hidden_size"]
        t["model.mtp_linear_proj.0.weight"] = torch.ones(hidden, 2 * hidden)
        t["model.mtp_emb_norm.0.weight"] = torch.ones(hidden)
        t["model.mtp_block.0.self_attn.q_proj.weight"] = torch.ones(hidden, hidden)

    (tmp_path / "mtp").mkdir()
    path = _rewrite(str(source), tmp_path / "mtp", add)
    loaded = load_model(ModelConfig.from_pretrained(path), torch.float32).state_dict()
    assert loaded.keys() == plain.keys()
    assert all(torch.equal(loaded[name], plain[name]) for name in plain)


def test_wrong_shape_is_reported(llama_dir, tmp_path):
    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:-1].clone()
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)

    path = _rewrite(llama_dir, tmp_path, shrink)
    with pytest.raises(ValueError, match="shape"):
        load_model(ModelConfig.from_pretrained(path), torch.float32)


def test_no_safetensors_is_an_error(llama_dir, tmp_path):
    (tmp_path / "config.json").write_text(open(f"{llama_dir}/config.json").read())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(ModelConfig.from_pretrained(str(tmp_path)), torch.float32)


def test_bfloat16_load_casts_and_runs(llama_dir):
    cfg = ModelConfig.from_pretrained(llama_dir)
    model32 = load_model(cfg, torch.float32)
    model16 = load_model(cfg, torch.bfloat16)
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}
    prompts = [[1, 5, 9, 200, 7], [3, 4]]
    out = {}
    for dtype, model in ((torch.float32, model32), (torch.bfloat16, model16)):
        h = PagedHarness(model, cfg, dtype)
        h.run([0, 1], prompts)
        out[dtype] = h.run([0, 1], [[11], [12]], mode=ForwardMode.DECODE)
    assert out[torch.bfloat16].dtype == torch.float32 and out[torch.bfloat16].shape == (2, VOCAB)
    assert torch.isfinite(out[torch.bfloat16]).all()
    scale = out[torch.float32].abs().max()
    assert (out[torch.bfloat16] - out[torch.float32]).abs().max() < 0.1 * scale


def test_gpt2_legacy_names_and_mask_buffers_load(tmp_path):
    """Old GPT-2 checkpoints: no `transformer.` prefix, `attn.bias` causal-mask buffers."""
    modern = tmp_path / "modern"
    save_random_model("gpt2", str(modern))

    def legacy(t):
        for name in list(t):
            t[name.removeprefix("transformer.")] = t.pop(name)
        t["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
        t["h.0.attn.masked_bias"] = torch.tensor(-1e4)

    (tmp_path / "legacy").mkdir()
    old = _rewrite(str(modern), tmp_path / "legacy", legacy)
    a = load_model(ModelConfig.from_pretrained(str(modern)), torch.float32).state_dict()
    b = load_model(ModelConfig.from_pretrained(old), torch.float32).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="Qwen3ForCausalLM") as err:
        get_model_class("FalconForCausalLM")
    assert "FalconForCausalLM" in str(err.value)
    assert {"LlamaForCausalLM", "GPT2LMHeadModel"} <= set(supported_architectures())


def test_unsupported_rope_type_fails_at_load(llama_dir, tmp_path):
    config = json.loads(open(f"{llama_dir}/config.json").read())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    _rewrite(llama_dir, tmp_path, lambda t: None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="dynamic"):
        load_model(ModelConfig.from_pretrained(str(tmp_path)), torch.float32)


def _phi35_rope(context_len: int | None) -> RotaryEmbedding:
    """Phi-3.5-mini's rope (its config's numbers, factors shortened to a 16-feature head)."""
    config = transformers.Phi3Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rope_theta=10000.0,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                      "long_factor": [1.1, 1.5, 2.5, 5.0, 12.0, 30.0, 50.0, 60.0]},
    )  # fmt: skip
    return RotaryEmbedding(16, 8192, rope_parameters(config), context_len=context_len)


def test_longrope_takes_its_factor_set_from_the_context_length():
    """The long factors once the served context is past the original 4096 positions (the
    default, the model's 131072), the short ones at 4096 or less; both scaled by
    sqrt(1 + ln(32) / ln(4096)) (transformers' attention factor for 131072 / 4096)."""
    long, short, unset = _phi35_rope(131072), _phi35_rope(4096), _phi35_rope(None)
    scale = math.sqrt(1 + math.log(32) / math.log(4096))
    for rope, factors in ((long, [1.1, 1.5]), (short, [1.0, 1.1]), (unset, [1.0, 1.1])):
        cos_at_1 = rope.cos_sin_cache[1, :2].double() / scale
        want = torch.tensor([1 / (f * 10000.0 ** (2 * i / 16)) for i, f in enumerate(factors)])
        torch.testing.assert_close(cos_at_1, want.double().cos(), atol=1e-6, rtol=0)
    # Phi-3's first configs named it "su", with the original length beside the dict
    legacy = types.SimpleNamespace(
        rope_scaling={"type": "su", "short_factor": [1.0], "long_factor": [2.0]},
        original_max_position_embeddings=4096, max_position_embeddings=131072,
    )  # fmt: skip
    params = rope_parameters(legacy)
    assert params["rope_type"] == "longrope" and params["rope_theta"] == 10000.0
    assert params["original_max_position_embeddings"] == 4096


def test_rope_factors_of_another_size_are_refused():
    params = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 3,
              "long_factor": [1.0] * 4, "original_max_position_embeddings": 8}  # fmt: skip
    with pytest.raises(ValueError, match="short_factor has 3 values; the rotary dimension 8"):
        RotaryEmbedding(8, 32, params)
    with pytest.raises(ValueError, match="even rotary dimension"):
        RotaryEmbedding(16, 32, {"rope_type": "default", "rope_theta": 1e4,
                                 "partial_rotary_factor": 0.35})  # fmt: skip


def test_legacy_rope_scaling_fields_are_read():
    """transformers 4.x configs: `rope_scaling` with `type`, `rope_theta` at top level."""
    legacy = type("Cfg", (), {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 1e6})
    params = rope_parameters(legacy())
    assert params["rope_type"] == "linear" and params["rope_theta"] == 1e6
    plain = compute_inv_freq(8, {"rope_type": "default", "rope_theta": 1e6})
    torch.testing.assert_close(compute_inv_freq(8, params), plain / 4.0)


@pytest.mark.parametrize(
    "make,want",
    [
        # Mistral v0.1 ships sliding_window 4096: every layer
        (lambda: transformers.MistralConfig(num_hidden_layers=3), (4096,) * 3),
        (lambda: transformers.MistralConfig(num_hidden_layers=2, sliding_window=None), (None,) * 2),
        # Qwen2.5 ships sliding_window 131072 with use_sliding_window false: no window
        (
            lambda: transformers.Qwen2Config(num_hidden_layers=2, sliding_window=131072),
            (None, None),
        ),
        (
            lambda: transformers.Qwen2Config(
                num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2
            ),
            (None, None, 64, 64),
        ),
        # Qwen2-MoE stores 0 for "no window"
        (lambda: transformers.Qwen2MoeConfig(num_hidden_layers=2), (None, None)),
        # gemma-3-1b: five local layers of 512 keys, then a global one
        (
            lambda: transformers.Gemma3TextConfig(num_hidden_layers=6, sliding_window=512),
            (512,) * 5 + (None,),
        ),
        # gemma-2: local and global layers alternate, the local ones of 4096 keys
        (lambda: transformers.Gemma2Config(num_hidden_layers=4), (4096, None, 4096, None)),
        # Llama has no sliding window even if a config carries the key
        (lambda: transformers.LlamaConfig(num_hidden_layers=2, sliding_window=16), (None, None)),
    ],
    ids=[
        "mistral", "mistral-off", "qwen2-off", "qwen2-upper-layers", "qwen2_moe-off", "gemma3",
        "gemma2", "llama",
    ],  # fmt: skip
)
def test_sliding_windows_per_layer_follow_transformers(make, want, tmp_path):
    make().save_pretrained(tmp_path)
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.sliding_windows == want
    assert cfg.sliding_window_sizes == {w for w in want if w}


def test_sliding_window_reaches_the_attention_layers(tmp_path):
    config = transformers.Qwen2Config(
        **LLAMA_SHAPE,
        use_sliding_window=True,
        sliding_window=7,
        max_window_layers=1,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_model(ModelConfig.from_pretrained(str(tmp_path)), torch.float32)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [None, 7]
    assert "sliding_window=7" in repr(model.model.layers[1].self_attn.attn)


@pytest.mark.parametrize(
    "make,want",
    [
        (lambda: transformers.Gemma2Config(num_hidden_layers=2), 50.0),
        (lambda: transformers.Gemma2Config(num_hidden_layers=2, attn_logit_softcapping=None), None),
        (lambda: transformers.Gemma3TextConfig(num_hidden_layers=2), None),
        (
            lambda: transformers.Gemma3TextConfig(num_hidden_layers=2, attn_logit_softcapping=2e1),
            20.0,
        ),
        # only Gemma's transformers code reads the key
        (lambda: transformers.LlamaConfig(num_hidden_layers=2, attn_logit_softcapping=2e1), None),
    ],
    ids=["gemma2", "gemma2-off", "gemma3", "gemma3-on", "llama"],
)
def test_attention_soft_cap_follows_transformers(make, want, tmp_path):
    make().save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(str(tmp_path)).attn_logit_cap == want


def test_soft_caps_reach_the_attention_layers_and_the_logits(tmp_path):
    config = transformers.Gemma2Config(
        **{**LLAMA_SHAPE, "num_attention_heads": 4, "num_key_value_heads": 2}, head_dim=16
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_model(ModelConfig.from_pretrained(str(tmp_path)), torch.float32)
    assert [layer.self_attn.attn.logit_cap for layer in model.model.layers] == [50.0, 50.0]
    assert model.logits_processor.soft_cap == 30.0
    assert "logit_cap=50.0" in repr(model.model.layers[0].self_attn.attn)


def test_a_multimodal_gemma3_checkpoint_loads_as_its_text_model(tmp_path):
    """gemma-3-4b and up: the text config describes the model; the text weights load from
    either layout (transformers saves `language_model.model.*`, its modules name them
    `model.language_model.*`), the vision tower is skipped, and a stray weight is an error."""
    src = tmp_path / "saved"
    save_random_model("gemma3-multimodal", str(src))
    cfg = ModelConfig.from_pretrained(str(src))
    assert (cfg.architecture, cfg.model_type) == ("Gemma3ForConditionalGeneration", "gemma3_text")
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 1, 32)
    assert cfg.sliding_windows == (5, None)
    saved = load_file(f"{src}/model.safetensors")
    assert any(k.startswith("vision_tower.") for k in saved)
    want = load_model(cfg, torch.float32).state_dict()
    assert torch.equal(want["model.embed_tokens.weight"],
                       saved["language_model.model.embed_tokens.weight"])  # fmt: skip

    def modules_layout(tensors: dict) -> None:
        for key in list(tensors):
            if key.startswith("language_model.model."):
                new = "model.language_model." + key.removeprefix("language_model.model.")
                tensors[new] = tensors.pop(key)
            elif key.startswith(("vision_tower.", "multi_modal_projector.")):
                tensors["model." + key] = tensors.pop(key)

    for name in ("renamed", "stray"):
        (tmp_path / name).mkdir()
    renamed = _rewrite(str(src), tmp_path / "renamed", modules_layout)
    got = load_model(ModelConfig.from_pretrained(renamed), torch.float32).state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    stray = _rewrite(str(src), tmp_path / "stray",
                     lambda t: t.update({"audio_tower.w": torch.zeros(2)}))  # fmt: skip
    with pytest.raises(Exception, match="audio_tower.w"):
        load_model(ModelConfig.from_pretrained(stray), torch.float32)
