"""Our models + loader + torch_native paged attention against Hugging Face transformers.

Random tiny HF models are saved to a tmp dir, loaded with `engine.loader.load_model`, and run
through hand-built ForwardBatches over a real KVPool; HF's full-sequence forward on the same
weights is the oracle. Comparisons run in float64 so a tight tolerance separates real bugs
from rounding; weights use a large init range so attention is sharp and a wrong mask, rope
or cache slot changes the logits visibly. One case runs in float32 as the engine does.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from engine.attention.base import create_attention_backend
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.loader import load_model
from engine.mem_cache.kv_pool import KVPool

transformers = pytest.importorskip("transformers")

from tests.arch_configs import ARCH_CONFIGS, LLAMA_SHAPE, VOCAB  # noqa: E402, F401 (re-exported)


def save_random_model(arch: str, path: str, **save_kwargs: object) -> None:
    torch.manual_seed(0)
    model = _auto_class(ARCH_CONFIGS[arch]()).from_config(ARCH_CONFIGS[arch]())
    with torch.no_grad():  # norms start at exactly 1/0; randomise them so they are tested
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):  # (DeepSeek-V3's, GLM-4.5's, ERNIE's)
                tensor.normal_(0.0, 0.1)
            if name.endswith("_proj_bias"):  # (gpt-oss's experts': zeros at init)
                tensor.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)


class PagedHarness:
    """Hand-rolled scheduler: a req_to_token table, pages handed out (optionally shuffled),
    and ForwardBatch construction for EXTEND and DECODE."""

    def __init__(self, model, cfg: ModelConfig, dtype, page_size: int = 1, shuffle: bool = False):
        self.model, self.page_size = model, page_size
        num_pages, rows, max_ctx = 64, 4, 128
        self.kv_pool = KVPool(
            num_pages * page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype,
            page_size=page_size, shared=cfg.kv_shared,
        )  # fmt: skip
        self.req_to_token = torch.zeros(rows, max_ctx, dtype=torch.int32)
        self.free_pages = list(range(1, num_pages))  # page 0 holds the padding slot
        if shuffle:
            random.Random(1).shuffle(self.free_pages)
        self.pages: dict[int, list[int]] = {r: [] for r in range(rows)}
        self.lens = [0] * rows
        self.backend = create_attention_backend("torch_native", device="cpu", page_size=page_size)

    def _alloc(self, row: int, new_len: int) -> list[int]:
        slots = []
        for pos in range(self.lens[row], self.lens[row] + new_len):
            if pos % self.page_size == 0:
                self.pages[row].append(self.free_pages.pop())
            slot = self.pages[row][pos // self.page_size] * self.page_size + pos % self.page_size
            self.req_to_token[row, pos] = slot
            slots.append(slot)
        return slots

    def run(
        self, rows: list[int], chunks: list[list[int]], mode=ForwardMode.EXTEND, all_logits=False
    ):
        prefix = [self.lens[r] for r in rows]
        slots = [s for r, c in zip(rows, chunks, strict=True) for s in self._alloc(r, len(c))]
        for r, c in zip(rows, chunks, strict=True):
            self.lens[r] += len(c)
        ext = [len(c) for c in chunks]
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=torch.tensor([t for c in chunks for t in c]),
            positions=torch.tensor(
                [p + i for p, n in zip(prefix, ext, strict=True) for i in range(n)]
            ),
            out_cache_loc=torch.tensor(slots),
            req_pool_indices=torch.tensor(rows),
            seq_lens=torch.tensor([self.lens[r] for r in rows]),
            seq_lens_cpu=[self.lens[r] for r in rows],
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.backend,
            extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=ext,
            extend_start_loc=torch.tensor([sum(ext[:i]) for i in range(len(ext))]),
            return_all_logits=all_logits,
        )
        if mode.is_decode():
            fb.extend_prefix_lens_cpu = fb.extend_seq_lens_cpu = fb.extend_start_loc = None
        self.backend.init_forward_metadata(fb)
        with torch.inference_mode():
            return self.model(fb.input_ids, fb.positions, fb)


PROMPT_LENS = [9, 14, 6]
NUM_DECODE = 4


class ArchCase:
    """One saved random model, our float64 load of it, and HF's float64 logits at every
    position of three fixed sequences (prompt + decode tokens): one HF forward each."""

    def __init__(self, arch: str, path: str) -> None:
        self.arch, self.path = arch, path
        self.cfg = ModelConfig.from_pretrained(path)
        self.model = load_model(self.cfg, torch.float64, "cpu")
        self.seqs = _random_ids([n + NUM_DECODE for n in PROMPT_LENS], seed=1)
        self.prompts = [s[:n] for s, n in zip(self.seqs, PROMPT_LENS, strict=True)]
        hf = _hf_model(path, torch.float64)
        self.refs = [_hf_logits(hf, s) for s in self.seqs]


@pytest.fixture(scope="module", params=list(ARCH_CONFIGS))
def case(request, tmp_path_factory) -> ArchCase:
    path = str(tmp_path_factory.mktemp(request.param))
    save_random_model(request.param, path)
    return ArchCase(request.param, path)


def _hf_model(path: str, dtype: torch.dtype):
    # eager experts: transformers' default grouped_mm has no float64
    hf = _auto_class(transformers.AutoConfig.from_pretrained(path)).from_pretrained(
        path, dtype=dtype, experts_implementation="eager"
    )
    return hf.eval()


def _auto_class(config):
    """AutoModelForCausalLM, or the image-text one for Mistral 3 (not in the causal map)."""
    if config.model_type == "mistral3":
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def _random_ids(lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    eager = hf.config._attn_implementation == "eager"
    with (
        torch.no_grad(),
        _float64_softmax() if eager else contextlib.nullcontext(),
        _float64_deepseek_v2_rope() if hf.config.model_type == "deepseek_v2" else (
            contextlib.nullcontext()),
        _float64_ernie_rope(hf.config.model_type) if hf.config.model_type.startswith("ernie") else (
            contextlib.nullcontext()),
    ):  # fmt: skip
        return hf(torch.tensor([ids])).logits[0]


@contextlib.contextmanager
def _float64_ernie_rope(model_type: str):
    """transformers' ERNIE 4.5 rotates q and k in float32 whatever the model's dtype
    (`q.float() * cos`): 2e-6 of noise in the float64 oracle. For the duration, the same
    rotation in the inputs' precision with float32's cos and sin (the model's table)."""
    import importlib

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")

    original = module.apply_rotary_pos_emb

    def rotate(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = (
            t.unsqueeze(unsqueeze_dim)[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1)
            for t in (cos, sin)
        )
        return tuple(
            x * cos.to(x.dtype) + module.rotate_half(x) * sin.to(x.dtype) for x in (q, k)
        )

    module.apply_rotary_pos_emb = rotate
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = original


@contextlib.contextmanager
def _float64_deepseek_v2_rope():
    """transformers' DeepSeek-V2 rotates q and k as complex64 whatever the model's dtype
    (`xq.float()`), and takes cos/sin from `torch.polar`, an ulp off float32's cos and sin in
    places: 2e-6 of noise in the float64 oracle. For the duration, the same complex product
    in the inputs' precision, with float32's cos and sin (those of the model's table: that
    rounding is the model's, the engine's too)."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as module

    original, polar = module.apply_rotary_emb, torch.polar

    def rotate(xq, xk, freqs_cis):
        out = []
        for x in (xq, xk):
            pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
            turned = pairs * freqs_cis.unsqueeze(1).to(pairs.dtype)
            out.append(torch.view_as_real(turned).flatten(3).type_as(x))
        return tuple(out)

    module.apply_rotary_emb = rotate
    torch.polar = lambda length, angle: torch.complex(length * angle.cos(), length * angle.sin())
    try:
        yield
    finally:
        module.apply_rotary_emb, torch.polar = original, polar


@contextlib.contextmanager
def _float64_softmax():
    """transformers' eager attention (Gemma 2's: SDPA cannot soft-cap) takes its softmax in
    float32 even for a float64 model, which leaves 1e-6 of noise in the float64 oracle's
    logits; for the duration, a softmax asked for float32 of a float64 input stays float64.
    (Only for eager models: the MoE routers' float32 softmax is what the engine matches.)"""
    softmax = torch.nn.functional.softmax

    def float64_softmax(x, *args, dtype=None, **kwargs):
        if x.dtype == torch.float64:
            dtype = None
        return softmax(x, *args, dtype=dtype, **kwargs)

    torch.nn.functional.softmax = float64_softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = softmax


def _close(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref.float(), atol=atol, rtol=0)


def test_prefill_batch_matches_hf(case):
    harness = PagedHarness(case.model, case.cfg, torch.float64)
    last = harness.run([0, 1, 2], case.prompts)
    assert last.shape == (3, VOCAB)
    _close(
        last,
        torch.stack([r[n - 1] for r, n in zip(case.refs, PROMPT_LENS, strict=True)]),
        atol=1e-6,
    )


def test_return_all_logits_matches_hf(case):
    harness = PagedHarness(case.model, case.cfg, torch.float64)
    every = harness.run([2, 0, 1], case.seqs, all_logits=True)
    assert every.shape == (sum(PROMPT_LENS) + 3 * NUM_DECODE, VOCAB)
    _close(every, torch.cat(case.refs), atol=1e-6)


@pytest.mark.parametrize("page_size,shuffle", [(1, False), (4, True)])
def test_chunked_extend_then_decode_matches_hf(case, page_size, shuffle):
    h = PagedHarness(case.model, case.cfg, torch.float64, page_size=page_size, shuffle=shuffle)
    rows = [3, 1, 2]
    halves = [n // 2 for n in PROMPT_LENS]
    first = h.run(rows, [p[:n] for p, n in zip(case.prompts, halves, strict=True)])
    _close(
        first, torch.stack([r[n - 1] for r, n in zip(case.refs, halves, strict=True)]), atol=1e-6
    )
    second = h.run(
        rows, [p[n:] for p, n in zip(case.prompts, halves, strict=True)], all_logits=True
    )
    want = torch.cat([r[n:p] for r, n, p in zip(case.refs, halves, PROMPT_LENS, strict=True)])
    _close(second, want, atol=1e-6)
    for step in range(NUM_DECODE):
        tokens = [[s[n + step]] for s, n in zip(case.seqs, PROMPT_LENS, strict=True)]
        logits = h.run(rows, tokens, mode=ForwardMode.DECODE)
        want = torch.stack([r[n + step] for r, n in zip(case.refs, PROMPT_LENS, strict=True)])
        _close(logits, want, atol=1e-6)


def test_float32_matches_hf(case):
    """float32 as the engine runs on CPU: prefill with page_size 2 (shuffled), then decode."""
    model = load_model(case.cfg, torch.float32, "cpu")
    hf = _hf_model(case.path, torch.float32)
    refs = [_hf_logits(hf, s) for s in case.seqs]
    h = PagedHarness(model, case.cfg, torch.float32, page_size=2, shuffle=True)
    logits = h.run([0, 1, 2], case.prompts)
    _close(
        logits, torch.stack([r[n - 1] for r, n in zip(refs, PROMPT_LENS, strict=True)]), atol=1e-4
    )
    logits = h.run(
        [0, 1, 2], [[s[n]] for s, n in zip(case.seqs, PROMPT_LENS, strict=True)], ForwardMode.DECODE
    )
    _close(logits, torch.stack([r[n] for r, n in zip(refs, PROMPT_LENS, strict=True)]), atol=1e-4)


def test_sharded_checkpoint_loads_identically(case, tmp_path):
    save_random_model(case.arch, str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded = load_model(ModelConfig.from_pretrained(str(tmp_path)), torch.float64).state_dict()
    single = case.model.state_dict()
    assert single.keys() == sharded.keys()
    for name, tensor in single.items():
        assert torch.equal(tensor, sharded[name]), name
