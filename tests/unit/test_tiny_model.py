"""``sluice make-tiny-model`` folders: loadable by transformers, sane tokenizers, useful weights."""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.tokenizer import apply_chat_template, load_tokenizer
from services.tiny_model import ARCHS, add_parser, build_config, make_tiny_model
from services.tiny_tokenizer import BYTE_FALLBACK_ARCHS, build_tokenizer

ROUND_TRIP_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # 42\n",
    "你好，世界！今天天气很好。東京は日本の首都です。안녕하세요",
    "Emoji: 😀🎉 👩‍💻 🇫🇷 🦀 ❤️",
    "Café crème brûlée, naïve façade, Dvořák in Łódź, Ελληνικά, Привет",
    " leading space, two  spaces, trailing space ",
    "tabs\tand\r\nwindows newlines\n\n",
    "<not special> <0x41> <|imstart|> {json: [1, 2.5e-3]}",
]
# Characters the synthetic corpus does not contain: the llama family spells them in <0x..> tokens.
RARE_TEXT = "Rare: 🦀 龍 ẞ ⅷ"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there 👋"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Count to three."},
]
PROMPTS = ["The quick brown fox", "def add(a, b):", "你好，世界", "1, 2, 3, 4,", "Once upon a time"]
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from threads, and on a busy machine (tests in parallel) two
    spinning OpenMP threads made generation ~20x slower (0.5 s -> 10 s per batch)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def greedy_runs(model_dirs: dict[str, str]) -> dict[str, tuple[list[float], list[list[int]]]]:
    """Per arch: top1 - top2 logit gaps at every greedy step, and the generated ids per prompt."""
    runs = {}
    for arch, path in model_dirs.items():
        tokenizer = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # No eos: min_new_tokens would mask the eos ids and hide them from greedy and the gaps.
        model.generation_config.eos_token_id = None
        batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")  # padded on the left
        out = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=NUM_NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
        )
        top2 = torch.stack(out.logits).topk(2, dim=-1).values  # [steps, prompts, 2]
        gaps = (top2[..., 0] - top2[..., 1]).flatten().tolist()
        outputs = out.sequences[:, batch.input_ids.shape[1] :].tolist()
        runs[arch] = (gaps, outputs)
    return runs


def _weights_hash(path: str) -> str:
    tensors = load_file(str(Path(path) / "model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].float().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_folder_loads_with_transformers(model_dirs: dict[str, str], arch: str) -> None:
    path = model_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == arch
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.padding_side == "left"
    generation = json.loads((Path(path) / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [
        tokenizer.eos_token_id,
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    assert generation["pad_token_id"] == tokenizer.pad_token_id is not None


@pytest.mark.parametrize("arch", ARCHS)
def test_load_tokenizer_equals_auto_tokenizer(model_dirs: dict[str, str], arch: str) -> None:
    # For qwen2, AutoTokenizer builds Qwen2Tokenizer, which rebuilds the pipeline from vocab and
    # merges; the folder's tokenizer.json must already be exactly that pipeline.
    ours, auto = load_tokenizer(model_dirs[arch]), AutoTokenizer.from_pretrained(model_dirs[arch])
    ours_json = json.loads(ours.backend_tokenizer.to_str())
    auto_json = json.loads(auto.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "model", "decoder", "post_processor"):
        assert ours_json[part] == auto_json[part], part
    specials_and_unnormalized = ["<|im_start|>user\nhi<|im_end|>", "e\u0301 \uff26 \u2460"]
    texts = ROUND_TRIP_TEXTS + [RARE_TEXT] + specials_and_unnormalized
    for text in texts:
        assert ours.encode(text) == auto.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == auto.encode(
            text, add_special_tokens=False
        )
    assert ours.all_special_tokens == auto.all_special_tokens
    assert apply_chat_template(ours, MESSAGES) == apply_chat_template(auto, MESSAGES)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_inverts_encode(model_dirs: dict[str, str], arch: str) -> None:
    tokenizer = load_tokenizer(model_dirs[arch])
    for text in ROUND_TRIP_TEXTS + [RARE_TEXT]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    if arch in BYTE_FALLBACK_ARCHS:
        assert tokenizer.encode("x")[0] == tokenizer.bos_token_id
    else:
        assert tokenizer.encode("x") == tokenizer.encode("x", add_special_tokens=False)


@pytest.mark.parametrize("arch", BYTE_FALLBACK_ARCHS)
def test_byte_fallback_tokens_are_ordinary(model_dirs: dict[str, str], arch: str) -> None:
    tokenizer = load_tokenizer(model_dirs[arch])
    ids = tokenizer.encode(RARE_TEXT, add_special_tokens=False)
    byte_ids = [i for i, t in zip(ids, tokenizer.convert_ids_to_tokens(ids)) if t.startswith("<0x")]
    assert len(byte_ids) >= 4 * 3  # the crab alone is four bytes
    assert not set(byte_ids) & set(tokenizer.all_special_ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == RARE_TEXT
    assert tokenizer.convert_tokens_to_ids("<0x00>") == len(tokenizer.all_special_tokens)


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template(model_dirs: dict[str, str], arch: str) -> None:
    tokenizer = load_tokenizer(model_dirs[arch])
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token if arch in BYTE_FALLBACK_ARCHS else ""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in MESSAGES)
    assert text == bos + turns + "<|im_start|>assistant\n"
    ids = apply_chat_template(tokenizer, MESSAGES)
    via_transformers = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert ids == list(getattr(via_transformers, "input_ids", via_transformers))
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == len(MESSAGES) + 1 and ids.count(im_end) == len(MESSAGES)
    assert tokenizer.decode(ids, skip_special_tokens=True).count("Hi there 👋") == 1
    without_prompt = apply_chat_template(tokenizer, MESSAGES, add_generation_prompt=False)
    assert without_prompt[-1] != im_start and ids[: len(without_prompt)] == without_prompt


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_logits_are_peaked(greedy_runs: dict, arch: str) -> None:
    # float32 rounding moves these logits by < 1e-4 (measured against float64), so a median
    # top1 - top2 gap of 0.5 (measured: 1.4-1.9) leaves greedy ties to chance of order 1e-4.
    gaps, _ = greedy_runs[arch]
    assert len(gaps) == len(PROMPTS) * NUM_NEW_TOKENS
    assert statistics.median(gaps) > 0.5
    assert sum(gap < 0.01 for gap in gaps) <= len(gaps) // 50


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_is_not_degenerate(greedy_runs: dict, arch: str) -> None:
    _, outputs = greedy_runs[arch]
    assert len({tuple(ids[:8]) for ids in outputs}) == len(PROMPTS)
    for ids in outputs:
        assert len(set(ids)) >= NUM_NEW_TOKENS // 3, ids


def test_build_is_reproducible(model_dirs: dict[str, str], tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", arch="llama", seed=0)
    other = make_tiny_model(tmp_path / "other", arch="llama", seed=1)
    assert _weights_hash(again) == _weights_hash(model_dirs["llama"]) != _weights_hash(other)
    saved = (Path(model_dirs["llama"]) / "tokenizer.json").read_bytes()
    assert (Path(again) / "tokenizer.json").read_bytes() == saved


@pytest.mark.parametrize("arch, names", [
    ("llama", ("self_attn.q_proj.weight", "self_attn.k_proj.weight")),
    ("gpt2", ("attn.c_attn.weight",)),
    ("phi3", ("self_attn.qkv_proj.weight",)),
])  # fmt: skip
def test_qk_scale_scales_queries_and_keys_only(tmp_path: Path, arch: str, names: tuple) -> None:
    """--qk-scale 1 against the default 2: the query and key weights (GPT-2: the fused
    c_attn's q and k columns; Phi-3: the fused qkv_proj's q and k rows) half as large, every
    other tensor the same."""
    sharp = load_file(str(Path(make_tiny_model(tmp_path / "a", arch=arch)) / "model.safetensors"))
    plain = load_file(str(Path(make_tiny_model(tmp_path / "b", arch=arch, qk_scale=1.0))
                          / "model.safetensors"))  # fmt: skip
    assert sharp.keys() == plain.keys()
    for key, tensor in sharp.items():
        if not any(key.endswith(n) for n in names):
            assert torch.equal(tensor, plain[key]), key
        elif arch == "gpt2":  # [hidden, 3 * hidden]: q and k, then v
            qk = tensor.shape[0] * 2
            torch.testing.assert_close(tensor[:, :qk], 2 * plain[key][:, :qk])
            assert torch.equal(tensor[:, qk:], plain[key][:, qk:])
        elif arch == "phi3":  # [q; k; v] rows: 4 query heads and 2 K/V heads of 16
            torch.testing.assert_close(tensor[:96], 2 * plain[key][:96])
            assert torch.equal(tensor[96:], plain[key][96:])
        else:
            torch.testing.assert_close(tensor, 2 * plain[key])
    with pytest.raises(ValueError, match="decoder models"):
        make_tiny_model(tmp_path / "c", arch="bert", qk_scale=1.0)


def test_tiny_weights_carry_biases_and_norms(model_dirs: dict[str, str]) -> None:
    tensors = load_file(str(Path(model_dirs["qwen2"]) / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.bias"].abs().max() > 0.1
    assert tensors["model.layers.0.input_layernorm.weight"].std() > 0.01
    assert "lm_head.weight" not in tensors  # tied, as Qwen2-0.5B


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_big_vocabulary_is_padded_with_decodable_fillers(arch: str) -> None:
    tokenizer = build_tokenizer(arch, 6000)
    assert len(tokenizer) == 6000
    tokens = tokenizer.convert_ids_to_tokens(list(range(6000)))
    assert len(set(tokens)) == 6000
    assert tokenizer.decode([5999]) == " tok5999"


def test_presets_have_the_real_shapes() -> None:
    gpt2 = build_config(preset="gpt2-124m")
    assert (gpt2.model_type, gpt2.n_embd, gpt2.n_layer, gpt2.n_head) == ("gpt2", 768, 12, 12)
    assert (gpt2.vocab_size, gpt2.n_positions, gpt2.tie_word_embeddings) == (50257, 1024, True)
    llama = build_config(preset="llama-3.2-1b")
    shape = (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads)
    assert (llama.model_type, *shape, llama.num_key_value_heads) == ("llama", 2048, 16, 32, 8)
    assert (llama.intermediate_size, llama.vocab_size, llama.head_dim) == (8192, 128256, 64)
    assert llama.tie_word_embeddings
    rope = llama.rope_parameters
    assert (rope["rope_type"], rope["rope_theta"], rope["factor"]) == ("llama3", 500000.0, 32.0)
    small = build_config(preset="small")
    assert (small.hidden_size, small.num_hidden_layers, small.num_key_value_heads) == (1024, 8, 4)
    assert (small.intermediate_size, small.vocab_size) == (2816, 32000)


def test_tiny_architecture_details() -> None:
    qwen3 = build_config("qwen3")
    assert qwen3.head_dim != qwen3.hidden_size // qwen3.num_attention_heads
    assert build_config("mistral").sliding_window is None
    llama = build_config("llama")
    assert llama.num_key_value_heads < llama.num_attention_heads
    assert build_config("llama", num_layers=3, hidden_size=32).num_hidden_layers == 3
    with pytest.raises(ValueError):
        build_config("gpt2", num_kv_heads=1)


def test_mixture_of_experts_settings() -> None:
    qwen3 = build_config("qwen3_moe", num_experts=6, num_experts_per_tok=3)
    assert (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.norm_topk_prob) == (6, 3, True)
    assert qwen3.moe_intermediate_size == qwen3.intermediate_size // 4
    assert qwen3.mlp_only_layers == [] and qwen3.decoder_sparse_step == 1
    qwen2 = build_config("qwen2_moe", moe_intermediate_size=24)
    assert (qwen2.moe_intermediate_size, qwen2.norm_topk_prob) == (24, False)
    assert qwen2.shared_expert_intermediate_size == qwen2.intermediate_size
    mixtral = build_config("mixtral", num_experts=4)
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
    with pytest.raises(ValueError, match="has no experts"):
        build_config("llama", num_experts=4)


@pytest.mark.parametrize(
    "arch,want",
    [
        ("mistral", (16, 16, 16, 16)),
        ("qwen3", (16, 16, 16, 16)),
        ("qwen2_moe", (16, None, 16, None)),  # its config windows the even layers
    ],
)
def test_sliding_window_setting(arch: str, want: tuple) -> None:
    from engine.layer_windows import layer_sliding_windows

    config = build_config(arch, num_layers=4, sliding_window=16)
    assert layer_sliding_windows(config, 4) == want
    assert layer_sliding_windows(build_config(arch, num_layers=4), 4) == (None,) * 4
    with pytest.raises(ValueError, match="no sliding window"):
        build_config("llama", sliding_window=16)


@pytest.mark.parametrize("arch,window", [("gemma2", 4096), ("gemma3_text", 512)])
def test_gemma_always_has_local_and_global_layers(arch, window) -> None:
    from engine.layer_windows import attn_logit_cap, layer_sliding_windows

    tiny = build_config(arch, num_layers=4)
    assert layer_sliding_windows(tiny, 4) == (32, None, 32, None)
    assert tiny.query_pre_attn_scalar == tiny.head_dim
    small = build_config(arch, preset="small")
    assert set(layer_sliding_windows(small, small.num_hidden_layers)) == {window, None}
    assert build_config(arch, sliding_window=8).sliding_window == 8
    # Gemma 2 keeps its soft caps (attention 50, final logits 30); Gemma 3 has none
    assert attn_logit_cap(tiny) == (50.0 if arch == "gemma2" else None)


def test_command_line(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["make-tiny-model", str(tmp_path), "--arch", "qwen3", "--num-layers", "1",
         "--hidden-size", "32", "--head-dim", "16", "--vocab-size", "700", "--dtype", "bfloat16",
         "--sliding-window", "8", "--qk-scale", "1.5"]
    )
    assert args.qk_scale == 1.5
    assert args.func(args) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (1, 32, 16)
    assert (config["vocab_size"], config["dtype"]) == (700, "bfloat16")
    assert (config["sliding_window"], config["layer_types"]) == (8, ["sliding_attention"])
    assert len(load_tokenizer(tmp_path)) == 700


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tools_and_tool_turns_reach_the_chat_template(
    model_dirs: dict[str, str], arch: str
) -> None:
    """The tokenizer service renders tools, an assistant's calls (arguments sent as JSON text,
    given to the template as a mapping, as transformers expects) and tool results, exactly as
    transformers renders them; the tiny template writes them in the Hermes format."""
    from services.tokenize_request import RequestError, RequestTokenizer, model_limits
    from shared.messages import ChatMessage, TokenizeReqMsg

    tokenizer = load_tokenizer(model_dirs[arch])
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather"}}
    turns = [
        ChatMessage("user", "Weather in Oslo?"),
        ChatMessage("assistant", "", tool_calls=[
            {**call, "function": {**call["function"], "arguments": '{"city":"Oslo"}'}}]),
        ChatMessage("tool", "snow", tool_call_id="c1"),
    ]  # fmt: skip
    service = RequestTokenizer(tokenizer, *model_limits(model_dirs[arch]))
    msg = TokenizeReqMsg("r", "router", "w", messages=turns, tools=[TOOL])
    ids = service.to_generate(msg).input_ids
    reference = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {**call, "function": {**call["function"], "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "snow", "tool_call_id": "c1"},
    ]  # fmt: skip
    text = tokenizer.apply_chat_template(
        reference, tools=[TOOL], tokenize=False, add_generation_prompt=True
    )
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    written = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert f"<tool_call>\n{written}\n</tool_call>" in text
    assert "<tool_response>\nsnow\n</tool_response>" in text
    plain = TokenizeReqMsg("r", "router", "w", messages=turns[:1])
    assert "<tools>" not in tokenizer.decode(service.to_generate(plain).input_ids)
    bad = TokenizeReqMsg("r", "router", "w", messages=turns, chat_template_kwargs={"tools": []})
    with pytest.raises(RequestError, match="'tools' is set by sluice"):
        service.to_generate(bad)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_continue_final_message_leaves_the_assistant_turn_open(
    model_dirs: dict[str, str], arch: str
) -> None:
    """A prefill: the last (assistant) message is rendered without its end, as transformers
    renders it with continue_final_message; no generation prompt, or neither, as asked."""
    from services.tokenize_request import RequestError, RequestTokenizer, model_limits
    from shared.messages import ChatMessage, TokenizeReqMsg

    tokenizer = load_tokenizer(model_dirs[arch])
    service = RequestTokenizer(tokenizer, *model_limits(model_dirs[arch]))
    turns = [ChatMessage("user", "List three colors."), ChatMessage("assistant", "1. red\n2.")]
    reference = [{"role": t.role, "content": t.content} for t in turns]

    def ids_of(**options: bool) -> list[int]:
        msg = TokenizeReqMsg("r", "router", "w", messages=turns, **options)
        return service.to_generate(msg).input_ids

    prefill = ids_of(add_generation_prompt=False, continue_final_message=True)
    text = tokenizer.apply_chat_template(
        reference, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert prefill == tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith("1. red\n2.")
    closed = ids_of(add_generation_prompt=False)
    assert tokenizer.decode(closed).rstrip().endswith("<|im_end|>")
    assert len(ids_of()) > len(closed)  # the generation prompt opens a new assistant turn
    bad = TokenizeReqMsg("r", "router", "w", messages=turns,
                         chat_template_kwargs={"continue_final_message": True})  # fmt: skip
    with pytest.raises(RequestError, match="'continue_final_message' is set by sluice"):
        service.to_generate(bad)
