"""The lm_head matmul into aligned rows (engine/layers/logits.py): where the vocabulary is not
a multiple of 8, CUDA in 16 bits writes the logits into rows of a multiple of 64 (cuBLAS's
aligned kernels); the values are F.linear's, and the float32 logits the sampler reads are
contiguous. On CPU the padded path is forced to test it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardMode
from engine.layers import logits as mod


@pytest.mark.parametrize("vocab", [50257, 97, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_matmul_equals_linear(vocab: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(5, 32, dtype=dtype)
    weight = torch.randn(vocab, 32, dtype=dtype)
    out = mod.lm_head_matmul(hidden, weight, pad=True)
    assert out.shape == (5, vocab) and out.stride(0) % mod.ROW_MULTIPLE == 0
    assert torch.equal(out, F.linear(hidden, weight))
    assert out.float().is_contiguous()


def test_padding_is_the_default_only_on_cuda_in_16_bits(monkeypatch) -> None:
    """Off CUDA, in float32, or with an aligned vocabulary: F.linear's contiguous logits."""
    seen = []
    monkeypatch.setattr(mod.torch, "mm", lambda *a, **k: seen.append(k) or F.linear(a[0], a[1].t()))
    hidden = torch.randn(3, 16, dtype=torch.bfloat16)
    out = mod.lm_head_matmul(hidden, torch.randn(97, 16, dtype=torch.bfloat16))
    assert out.is_contiguous() and not seen


def test_logits_processor_rows_are_the_plain_ones(monkeypatch) -> None:
    """Through LogitsProcessor (decode: one row per request), padded or not, into a fresh
    tensor or into a CUDA graph's buffer (`logits_out`): the same logits. A float32 buffer
    gets the conversion; a buffer of the model's dtype the matmul's own output (in place,
    over the weight's padded rows where it has them), not converted."""
    torch.manual_seed(1)
    hidden = torch.randn(4, 16, dtype=torch.bfloat16)
    weight = torch.randn(101, 16, dtype=torch.bfloat16)
    fb = SimpleNamespace(pooling=None, return_all_logits=False, forward_mode=ForwardMode.DECODE,
                         logits_out=None)  # fmt: skip
    proc = mod.LogitsProcessor(101)
    plain = proc(hidden, weight, fb)
    real = mod.lm_head_matmul
    monkeypatch.setattr(mod, "lm_head_matmul", lambda h, w, **kw: real(h, w, pad=True, **kw))
    padded = proc(hidden, weight, fb)
    assert padded.dtype == torch.float32 and padded.is_contiguous()
    assert torch.equal(padded, plain)
    fb.logits_out = torch.full((4, 101), float("nan"))
    written = proc(hidden, weight, fb)
    assert written.data_ptr() == fb.logits_out.data_ptr() and torch.equal(written, plain)
    padded_weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    assert mod.pad_vocab_rows(padded_weight)
    for w in (weight, padded_weight):
        fb.logits_out = torch.full((4, 128), float("nan"), dtype=torch.bfloat16)
        written = proc(hidden, w, fb)
        assert written.dtype == torch.bfloat16 and written.shape == (4, 101)
        assert written.data_ptr() == fb.logits_out.data_ptr()
        assert torch.equal(written.float(), plain)
        # the matmul ran over the 128 rows (zeros after the vocabulary) where there are 128
        assert fb.logits_out[:, 101:].isnan().all() == (w is weight)
        assert (fb.logits_out[:, 101:] == 0).all() == (w is padded_weight)


def test_pad_vocab_rows_keeps_the_parameter_and_its_values() -> None:
    """The weight becomes the first 97 of 128 rows of a new storage (zeros after): the same
    Parameter object, so a tied input embedding reads the same values; a second call finds
    the rows there."""
    torch.manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(97, 16, dtype=torch.bfloat16), requires_grad=False)
    embed = torch.nn.Embedding(97, 16)
    embed.weight = weight  # tied: the same Parameter
    values = weight.detach().clone()
    ids = torch.tensor([0, 5, 96])
    assert mod.padded_rows(weight, 128) is None
    assert mod.pad_vocab_rows(weight)
    assert embed.weight is weight and torch.equal(weight, values)
    assert torch.equal(embed(ids), values[ids])
    rows = mod.padded_rows(weight, 128)
    assert rows is not None and rows.shape == (128, 16) and rows.data_ptr() == weight.data_ptr()
    assert (rows[97:] == 0).all()
    assert not mod.pad_vocab_rows(weight)
    weight.data.copy_(values * 2)  # a weight reload copies into the view: the rows follow
    assert torch.equal(mod.padded_rows(weight, 128)[:97], values * 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_matmul_runs_over_the_padded_rows(dtype: torch.dtype) -> None:
    """With the padded storage the GEMM covers all 128 rows (the rows after the vocabulary
    are set to NaN here: their columns, and only those, come out NaN); the logits are
    F.linear's."""
    torch.manual_seed(3)
    hidden = torch.randn(5, 32, dtype=dtype)
    weight = torch.randn(97, 32, dtype=dtype)
    want = F.linear(hidden, weight)
    assert mod.pad_vocab_rows(weight)
    mod.padded_rows(weight, 128)[97:] = float("nan")
    out = mod.lm_head_matmul(hidden, weight, pad=True)
    assert out.shape == (5, 97) and out.stride(0) == 128
    assert torch.equal(out, want)
    whole = torch.as_strided(out, (5, 128), out.stride())
    assert torch.isnan(whole[:, 97:]).all()


def test_runner_pads_the_lm_head_only_where_the_matmul_pads(monkeypatch) -> None:
    """ModelRunner._pad_lm_head: on CUDA in 16 bits (stood in for here by `pads_vocab`) the
    lm_head weight gets its padded storage; on CPU, or where the head is not the vocabulary's
    (a classifier's score rows), it is left alone."""
    from engine.model_runner import ModelRunner

    def runner(rows: int, vocab: int) -> SimpleNamespace:
        weight = torch.nn.Parameter(torch.randn(rows, 16, dtype=torch.bfloat16))
        model = SimpleNamespace(lm_head_weight=weight,
                                logits_processor=SimpleNamespace(vocab_size=vocab))  # fmt: skip
        return SimpleNamespace(model=model)

    on_cpu = runner(97, 97)
    ModelRunner._pad_lm_head(on_cpu)
    assert mod.padded_rows(on_cpu.model.lm_head_weight, 128) is None
    monkeypatch.setattr(mod, "pads_vocab", lambda hidden, vocab: vocab % mod.ALIGN != 0)
    padded, classifier = runner(97, 97), runner(3, 97)
    for r in (padded, classifier):
        ModelRunner._pad_lm_head(r)
    assert mod.padded_rows(padded.model.lm_head_weight, 128) is not None
    assert mod.padded_rows(classifier.model.lm_head_weight, 64) is None
