"""A served weight read back by its checkpoint name (SGLang's `get_weights_by_name`: how an
RL trainer checks that the weights it sent landed).

A checkpoint tensor is often not a parameter of its own: q, k and v are rows of one fused
projection, an expert's weights a slice of a stacked tensor, GPT-2's Conv1D weights are stored
transposed. Rather than a second, inverse copy of every model's name mapping, the loader
itself says where a tensor goes: a meta-device copy of the model loads a meta tensor of the
checkpoint tensor's shape (no memory, no data) while a dispatch mode records every `copy_`
(the destination, a view of a meta parameter; the source, a view of the probe). The same
views of the served parameter, copied back through the source's view, give the checkpoint
tensor as the model holds it. A tensor the loader computes from (an FP8 weight quantized as
it loads) cannot be read back this way, nor can the parts of a quantized checkpoint's weight
(its float8 or integer values and its scales, joined before anything is copied), and one it
skips (a head tied to the embedding) is not a weight of its own: all are refused with the
reason. A name that is not the checkpoint's but a model parameter's reads that parameter.
With tensor parallelism each rank reads its part the same way (the meta copy is built as that
rank's part, so the loader's own narrowing says where the part sits) and rank 0 puts the parts
together.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config import ModelConfig
from engine.distributed import SINGLE, TensorParallel
from engine.loader import build_model, fill_model
from engine.quantization import QuantConfig
from engine.weight_update import checkpoint_spec

# a quantized checkpoint's stored values: FP8's float8, W8A8's int8 (the integer formats'
# packed words are named parts)
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


class _Copies(TorchDispatchMode):
    """Every `copy_` dispatched meanwhile: (destination, source)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten.copy_.default:
            self.seen.append((args[0], args[1]))
        return func(*args, **(kwargs or {}))


def read_weight(
    model: nn.Module,
    model_config: ModelConfig,
    checkpoint: str,
    dtype: torch.dtype,
    quantization: QuantConfig | None,
    name: str,
) -> torch.Tensor:
    """The served value of the checkpoint tensor `name` (of the checkpoint in `checkpoint`,
    which gives its shape), or of the parameter `name`, on the host. ValueError if there is
    neither, or if it cannot be read back."""
    return read_weight_part(model, model_config, checkpoint, dtype, quantization, name)[0]


def read_weight_part(
    model: nn.Module,
    model_config: ModelConfig,
    checkpoint: str,
    dtype: torch.dtype,
    quantization: QuantConfig | None,
    name: str,
    tp: TensorParallel = SINGLE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`read_weight` on rank `tp.rank` of a model split over `tp.size` ranks: the checkpoint
    tensor with this rank's part of it filled, and where (a bool tensor of its shape; all true
    for a parameter's own name, whose value is this rank's)."""
    params = dict(model.named_parameters())
    spec = checkpoint_spec(checkpoint, name)  # (a checkpoint name first: GPT-2's Conv1D
    if spec is None:  # weights are parameters of the same name, transposed)
        if name in params:
            value = params[name].detach().to("cpu")
            return value, torch.ones(value.shape, dtype=torch.bool)
        raise ValueError(f"no weight named {name!r} in the model or its checkpoint")
    if quantization is not None and quantization.checkpoint and (
        name.rpartition(".")[2] in (*quantization.parts, "input_scale")
        or spec[1] in _QUANTIZED_DTYPES
    ):  # (the loader joins a quantized weight's parts before anything is copied)
        raise ValueError(f"{name!r} cannot be read back: it is a part of a quantized weight "
                         "(its stored values or a scale), which the served layer holds "
                         "joined with the others")  # fmt: skip
    probe = torch.empty(spec[0], dtype=spec[1], device="meta")
    dry = build_model(model_config, dtype, "meta", quantization,
                      TensorParallel(tp.rank, tp.size, ep_size=tp.ep_size))  # fmt: skip
    owners = {p.untyped_storage()._cdata: (n, p) for n, p in dry.named_parameters()}
    copies = _Copies()
    with copies:
        fill_model(dry, [(name, probe)], checkpoint, quantization, partial=True)
    if not copies.seen and _other_groups_expert(dry):
        return torch.zeros(spec[0], dtype=dtype), torch.zeros(spec[0], dtype=torch.bool)
    if not copies.seen:
        raise ValueError(f"{name!r} is not a weight of its own in the served model (tied to "
                         "another, or derived)")  # fmt: skip
    out: torch.Tensor | None = None
    for dst, src in copies.seen:
        owner, loaded = owners.get(dst.untyped_storage()._cdata, (None, None))
        served = params[owner].detach() if owner in params else None
        if (
            served is None
            or src.untyped_storage()._cdata != probe.untyped_storage()._cdata
            or (served.dtype, served.shape) != (loaded.dtype, loaded.shape)
        ):  # (a tensor computed from it, or a parameter made anew after loading: FP8)
            raise ValueError(f"{name!r} cannot be read back: the served weight is computed "
                             "from it")  # fmt: skip
        values = served.as_strided(dst.size(), dst.stride(), dst.storage_offset())
        if out is None:
            out = torch.zeros(spec[0], dtype=served.dtype)
            filled = torch.zeros(spec[0], dtype=torch.bool)
        out.as_strided(src.size(), src.stride(), src.storage_offset()).copy_(values)
        filled.as_strided(src.size(), src.stride(), src.storage_offset()).fill_(True)
    assert out is not None
    return out, filled


def _other_groups_expert(model: nn.Module) -> bool:
    """Whether the weight just loaded into `model` was an expert another expert group holds
    (expert parallelism: this rank has no part of it)."""
    from engine.layers.moe import ExpertWeights

    return any(isinstance(m, ExpertWeights) and m.skipped for m in model.modules())
