"""gpt-oss (`GptOssForCausalLM`, OpenAI's open-weight models: gpt-oss-20b, gpt-oss-120b).

Llama's layer (engine/models/llama.py) with:
* biases on q, k, v and o_proj, every other layer windowed (`layer_types`, a window of 128),
  YaRN rope;
* attention sinks: a learned logit per query head joins each softmax as a key without a
  value (`PagedAttention.sinks`), so the real keys' weights sum to less than one. The Triton
  and torch_native backends compute them (Triton by default on CUDA; flashinfer is refused:
  engine/runner_attention.py);
* a mixture of experts in every layer: a router with a bias picks the top k experts, whose
  weights are the softmax of those k logits; each expert is a clamped SwiGLU with biases,
  `(up + 1) * gate * sigmoid(alpha * gate)` with gate clamped from above and up from both
  sides at `swiglu_limit`, its gate and up columns interleaved in `gate_up_proj`.

The experts keep the checkpoint's layout ([experts, in, out] for both projections). On CUDA
they run on the Triton grouped GEMMs (kernels/fused_moe.py, with the experts' biases and the
clamped SwiGLU between them; transposed views of the weights; no host read, so CUDA graphs
capture it). Elsewhere a batch of many rows runs one matmul per expert it routes to (which
ones: a host read); a few rows run every expert on every row and weight the results by a
dense routing matrix (`GptOssExperts.DENSE_ROWS`).
The published checkpoints' experts are MXFP4 (`*_blocks`: two 4-bit e2m1 values a byte, 32 a
group; `*_scales`: a power-of-two exponent a group): they are dequantized to the model's dtype
as they load (`dequantize_mxfp4`), and run as bf16 experts. Tensor parallelism is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.llama import LlamaForCausalLM

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the code's low 3 bits; bit 3 the sign


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """An MXFP4 expert tensor as the experts hold it: blocks [E, N, G, 16] uint8 (in each byte
    the lower nibble is the earlier value), scales [E, N, G] uint8 (2^(s - 127) for the group
    of 32) -> [E, G * 32, N] in `dtype` (the projection's [experts, in, out])."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not pair")  # fmt: skip
    lut = torch.tensor(FP4_E2M1 + tuple(-v for v in FP4_E2M1), device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [E, N, G, 16, 2]
    values = lut[codes].flatten(-2)  # [E, N, G, 32]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents[..., None].to(values.dtype))
    return values.flatten(-2).transpose(1, 2).to(dtype).contiguous()


class GptOssExperts(nn.Module):
    DENSE_ROWS = 32  # at most this many rows: every expert on every row, no host read

    def __init__(self, config) -> None:
        super().__init__()
        experts, hidden, inter = (
            config.num_local_experts, config.hidden_size, config.intermediate_size
        )  # fmt: skip
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.limit = float(config.swiglu_limit)

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H]; experts and weights [T, k]: each token's experts and their weights."""
        if x.is_cuda and _has_triton():
            return self.fused(x, experts, weights)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if x.shape[0] <= self.DENSE_ROWS or capturing:
            return self.dense(x, experts, weights)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            gate_up = x[token] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            y = self._glu(gate_up) @ self.down_proj[e] + self.down_proj_bias[e]
            out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
        return out

    def dense(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Every expert on every row ([E, T, .] batched matmuls), the results summed with the
        routing weights scattered into a [T, E] matrix (zeros for the experts not chosen)."""
        gate_up = torch.matmul(x, self.gate_up_proj) + self.gate_up_proj_bias[:, None, :]
        y = torch.bmm(self._glu(gate_up), self.down_proj) + self.down_proj_bias[:, None, :]
        routing = torch.zeros(x.shape[0], y.shape[0], dtype=weights.dtype, device=x.device)
        routing.scatter_(1, experts, weights)
        return torch.einsum("eth,te->th", y, routing.to(y.dtype)).to(x.dtype)

    def fused(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The Triton grouped GEMMs (kernels/fused_moe.py; the GPU's path): only the chosen
        experts' weights are read, with no host read (CUDA graphs capture it)."""
        from kernels.fused_moe import fused_experts_triton

        return fused_experts_triton(
            x, self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2), weights,
            experts, self.gate_up_proj_bias, self.down_proj_bias, self._glu,
        )  # fmt: skip

    def _glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of interleaved [gate, up] columns."""
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


class GptOssMoE(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, experts = torch.topk(self.router(x), self.top_k, dim=-1)
        return self.experts(x, experts, torch.softmax(top, dim=-1, dtype=top.dtype))


class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's layers with gpt-oss's switches (see the module's docstring)."""

    attention_sinks = True
    supports_tensor_parallel = False

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", True))
        return bias, bias

    @staticmethod
    def make_mlp(config, layer_id: int) -> nn.Module:
        return GptOssMoE(config)

    def load_weights(self, weights):
        self._mxfp4: dict[tuple[str, str], torch.Tensor] = {}  # a half read, its pair not yet
        loaded = super().load_weights(weights)
        if self._mxfp4:
            halves = sorted(f"{base}_{part}" for base, part in self._mxfp4)
            raise ValueError(f"MXFP4 tensors without their blocks or scales: {halves}")
        return loaded

    def _map_weight(self, name: str, tensor: torch.Tensor):
        if name.endswith(("_blocks", "_scales")):  # MXFP4 experts: dequantized once paired
            base, part = name.rsplit("_", 1)
            other = self._mxfp4.pop((base, "scales" if part == "blocks" else "blocks"), None)
            if other is None:
                self._mxfp4[base, part] = tensor
                return None
            blocks, scales = (tensor, other) if part == "blocks" else (other, tensor)
            dtype = self.lm_head_weight.dtype
            return super()._map_weight(base, dequantize_mxfp4(blocks, scales, dtype))
        if name.endswith(".self_attn.sinks"):  # the attention layer's, in PagedAttention
            name = name.removesuffix("sinks") + "attn.sinks"
        return super()._map_weight(name, tensor)


def _has_triton() -> bool:
    from kernels.jit import HAS_TRITON

    return HAS_TRITON
