"""Which attention backend a model runner picks when none is named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

# triton_backend imported before a test patches kernels.jit: imported under the patch, it
# would keep the patched `interpreting` for good (and the later Triton tests would fail)
from engine.attention import flashinfer_support, triton_backend  # noqa: F401
from engine.config import EngineArgs
from engine.model_runner import ModelRunner


def _choice(monkeypatch: pytest.MonkeyPatch, available: bool, dtype: torch.dtype,
            head_dim: int = 64, windows: set | None = None, **args: object) -> str:  # fmt: skip
    monkeypatch.setattr(flashinfer_support, "flashinfer_available", lambda: available)
    runner = ModelRunner.__new__(ModelRunner)  # only what the choice reads
    runner.args = EngineArgs.from_kwargs(model_path="m", **args)
    runner.model_config = SimpleNamespace(head_dim=head_dim, sliding_window_sizes=windows or set())
    runner.dtype = dtype
    return runner._attention_backend_name()


def test_flashinfer_by_default_on_cuda_where_it_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _choice(monkeypatch, True, torch.bfloat16, device="cuda") == "flashinfer"
    assert _choice(monkeypatch, True, torch.float16, 128, device="cuda:1") == "flashinfer"
    one_window = _choice(monkeypatch, True, torch.bfloat16, windows={4096}, device="cuda")
    assert one_window == "flashinfer"


@pytest.mark.parametrize(
    ("available", "dtype", "head_dim"),
    [(False, torch.bfloat16, 64), (True, torch.float32, 64), (True, torch.bfloat16, 96)],
)
def test_triton_when_flashinfer_cannot_run_the_model(
    monkeypatch: pytest.MonkeyPatch, available: bool, dtype: torch.dtype, head_dim: int
) -> None:
    assert _choice(monkeypatch, available, dtype, head_dim, device="cuda") == "triton"


def test_triton_for_a_model_of_two_sliding_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    two = _choice(monkeypatch, True, torch.bfloat16, windows={512, 4096}, device="cuda")
    assert two == "triton"


def test_a_named_backend_and_cpu_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _choice(monkeypatch, True, torch.float32, device="cpu") == "torch_native"
    named = _choice(
        monkeypatch, False, torch.float32, device="cuda", attention_backend="flashinfer"
    )
    assert named == "flashinfer"  # asked for: its constructor explains why it cannot run


def _phases(monkeypatch: pytest.MonkeyPatch, triton: bool = True,
            kv_dtype: torch.dtype = torch.bfloat16, capability: tuple[int, int] = (9, 0),
            model_type: str = "llama", **args: object):  # fmt: skip
    from kernels import jit

    monkeypatch.setattr(flashinfer_support, "flashinfer_available", lambda: True)
    monkeypatch.setattr(jit, "HAS_TRITON", triton)
    monkeypatch.setattr(jit, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    runner = ModelRunner.__new__(ModelRunner)
    runner.args = EngineArgs.from_kwargs(model_path="m", **args)
    runner.device = args.get("device", "cpu")
    runner.kv_pool = SimpleNamespace(dtype=kv_dtype)
    runner.model_config = SimpleNamespace(head_dim=64, sliding_window_sizes=set(),
                                          hf_config=SimpleNamespace(model_type=model_type))
    runner.dtype = torch.bfloat16
    return runner._attention_backend_names()


def test_attention_sinks_run_on_triton_or_torch_native():
    """gpt-oss (attention sinks): Triton for both phases where flashinfer would be the
    default, torch_native on the CPU, a named Triton / torch_native phase kept, flashinfer
    refused with the reason."""
    with pytest.MonkeyPatch.context() as mp:
        assert _phases(mp, model_type="gpt_oss", device="cuda") == ("triton", "triton")
        assert _phases(mp, model_type="gpt_oss") == ("torch_native", "torch_native")
        named = _phases(mp, model_type="gpt_oss", device="cuda",
                        decode_attention_backend="torch_native")  # fmt: skip
        assert named == ("triton", "torch_native")
        for flags in ({"attention_backend": "flashinfer"},
                      {"prefill_attention_backend": "flashinfer"}):  # fmt: skip
            with pytest.raises(ValueError, match="not flashinfer"):
                _phases(mp, model_type="gpt_oss", device="cuda", **flags)


def test_default_decode_is_tritons_where_flashinfer_is_chosen(monkeypatch):
    assert _phases(monkeypatch, device="cuda") == ("flashinfer", "triton")
    assert _phases(monkeypatch, triton=False, device="cuda") == ("flashinfer", "flashinfer")
    # a backend named is that backend for both phases, unless a phase names its own
    named = _phases(monkeypatch, device="cuda", attention_backend="flashinfer")
    assert named == ("flashinfer", "flashinfer")
    both = _phases(monkeypatch, device="cuda", decode_attention_backend="flashinfer")
    assert both == ("flashinfer", "flashinfer")
    assert _phases(monkeypatch, device="cuda", attention_backend="triton",
                   prefill_attention_backend="flashinfer") == ("flashinfer", "triton")  # fmt: skip
    assert _phases(monkeypatch, device="cpu") == ("torch_native", "torch_native")


def test_an_e4m3_cache_before_sm89_keeps_flashinfer_decode(monkeypatch):
    e4m3 = torch.float8_e4m3fn
    ampere = _phases(monkeypatch, kv_dtype=e4m3, capability=(8, 0), device="cuda")
    assert ampere == ("flashinfer", "flashinfer")  # Triton cannot read it there
    hopper = _phases(monkeypatch, kv_dtype=e4m3, capability=(9, 0), device="cuda")
    assert hopper == ("flashinfer", "triton")
    e5m2 = _phases(monkeypatch, kv_dtype=torch.float8_e5m2, capability=(8, 0), device="cuda")
    assert e5m2 == ("flashinfer", "triton")


def test_draft_trees_take_tritons_prefill_where_flashinfer_is_chosen(monkeypatch):
    """A verify step of draft trees is an extend with tree masks, which the Triton kernel has
    and flashinfer's wrappers (here) do not: where no backend is named both phases are
    Triton's; a named flashinfer prefill is kept (and refused later, with the reason)."""
    tree = {"speculative_algorithm": "eagle", "speculative_draft_model_path": "h",
            "speculative_num_draft_tokens": 6, "speculative_eagle_topk": 2}  # fmt: skip
    assert _phases(monkeypatch, device="cuda", **tree) == ("triton", "triton")
    chain = {**tree, "speculative_eagle_topk": 1}
    assert _phases(monkeypatch, device="cuda", **chain) == ("flashinfer", "triton")
    named = _phases(monkeypatch, device="cuda", prefill_attention_backend="flashinfer", **tree)
    assert named == ("flashinfer", "triton")
    assert _phases(monkeypatch, device="cpu", **tree) == ("torch_native", "torch_native")
