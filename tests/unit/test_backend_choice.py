"""Which attention backend a model runner picks when none is named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.attention import flashinfer_support
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
