"""FP8 weights: which a model runs with, and the module swap that applies it.

* An FP8 checkpoint (config.json `quantization_config.quant_method: "fp8"`: Qwen3-*-FP8,
  DeepSeek-V3 style, transformers' FineGrainedFP8) loads its float8 weights as stored, with
  their `weight_scale_inv` block scales (`weight_block_size`, e.g. 128 x 128) or per-tensor
  `weight_scale`s (held per output channel, so stacked q/k/v keep their own). Activations are
  scaled per token (and block column) as they come: a checkpoint's static `input_scale`s are
  not used (`activation_scheme: static` runs as dynamic, as precise or more).
* `--quantization fp8` on a 16/32-bit checkpoint (vLLM's and SGLang's online FP8): once
  loaded, each linear layer of the transformer blocks is quantized per output channel.

Either way the quantized layers are the blocks' projections (`engine.layers.fp8.Fp8Linear`);
embeddings, the LM head, norms and MoE routers stay in the model dtype, as do the modules the
config's `modules_to_not_convert` / `ignored_layers` name. An FP8 checkpoint's float8 experts
stay float8 (`engine.layers.fp8_experts`, W8A16 in the grouped GEMMs); `--quantization fp8`
quantizes a 16-bit checkpoint's experts as it does the layers, a scale per row. Which
experts are swapped and when: engine/quantized_experts.py.

Integer weights (W4A16 / W8A16, `engine.layers.int_weight.IntWeightLinear`): a
compressed-tensors checkpoint (`quant_method: "compressed-tensors"`, format
"pack-quantized": llm-compressor's W4A16 / W8A16 schemes) loads its packed 4- or 8-bit
weights as stored, with their group (or channel) scales and, asymmetric, zero points; the
blocks' linear layers run on them, and so do MoE experts that the checkpoint stores packed
(`engine.layers.int_experts.IntExpertWeights`, the grouped GEMMs' integer path); the rest
as for FP8 (routers and other quantized weights dequantized as they load, the config's
`ignore` list left in the model dtype). compressed-tensors' "int-quantized" W8A8 (int8
weights per channel, activations per token) runs on `engine.layers.int8.Int8Linear`; its
int8 experts stay 8-bit too, as W8A16 integer experts (16-bit activations: the grouped GEMMs
have no int8-activation path).
compressed-tensors' activation ordering (`actorder: group`, a `weight_g_idx` per column),
FP8 activation schemes and its other formats are refused. AutoAWQ (GEMM) and GPTQ
checkpoints are repacked into the same layers as they load (engine/checkpoint_parts.py
joins every format's parts; GPTQ's activation ordering too, its columns sorted by group and
the layer's input permuted alike). The other methods (bitsandbytes, MXFP4 but gpt-oss's
experts...) are refused with their name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.checkpoint_parts import (
    AWQ_PARTS,
    GPTQ_PARTS,
    INT_PARTS,
    pair_awq_weights,
    pair_fp8_scales,
    pair_gptq_weights,
    pair_int8_weights,
    pair_int_weights,
)

if TYPE_CHECKING:
    from engine.layers.fp8 import QuantizedWeight


# The FP8 layer (and with it Triton) is imported where a model is quantized, not here: the
# CLI of every service reads QUANTIZATION_METHODS.
# `--quantization` of a checkpoint's own method (vLLM's flag names it): checked against it
CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors")
QUANTIZATION_METHODS = ("fp8", *CHECKPOINT_METHODS)
IN_BLOCK = re.compile(r"(^|\.)(layers|layer|h)\.\d+\.")  # a transformer block's module
_ROUTERS = ("gate", "shared_expert_gate")  # MoE routing logits: kept precise, as vLLM does


@dataclass(frozen=True)
class Fp8Config:
    checkpoint: bool  # the weights are stored in float8 (else quantized once loaded)
    block: tuple[int, int] | None = None  # weight_block_size; None: per output channel
    skip: tuple[str, ...] = ()  # module names left unquantized

    def swap(self, model: nn.Module, checkpoint: str | None = None) -> int:
        """The quantized layers swapped in, empty, for a checkpoint to fill (meta model); a
        MoE's float8 experts stay float8 (`swap_fp8_experts`)."""
        from engine.quantized_experts import swap_fp8_experts

        count = swap_in_fp8(model, self)
        return count + (swap_fp8_experts(model, self, checkpoint) if self.checkpoint else 0)

    @property
    def parts(self) -> tuple[str, ...]:
        """The checkpoint tensors a float8 weight's scales are stored as."""
        return ("weight_scale_inv", "weight_scale")

    def pair(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """A checkpoint's tensors with each quantized weight's parts joined."""
        return pair_fp8_scales(weights, self.block)


@dataclass(frozen=True)
class IntWeightConfig:
    """A compressed-tensors pack-quantized checkpoint: `bits`-bit weights, a scale per `group`
    input columns (None: per output channel), zero points unless `symmetric`."""

    bits: int
    group: int | None
    symmetric: bool
    skip: tuple[str, ...] = ()  # the config's `ignore`: module names, or "re:" patterns
    checkpoint: bool = True
    # "compressed-tensors"; "awq": AutoAWQ's GEMM tensors, "gptq" / "gptq_v2": GPTQ's (zero
    # points stored less one / as they are), both repacked as they load
    layout: str = "compressed-tensors"
    act_order: bool = False  # GPTQ's desc_act: the columns' groups in a g_idx

    def swap(self, model: nn.Module, checkpoint: str | None = None) -> int:
        """The integer layers swapped in, empty, for the checkpoint in `checkpoint` to fill
        (meta model); its experts too where it stores them packed."""
        from engine.layers.int_weight import IntWeightLinear

        count = replace_linears(model, self, lambda linear: IntWeightLinear.like(
            linear, self.bits, self.group, self.symmetric, self.act_order))  # fmt: skip
        return count + self._swap_experts(model, checkpoint)

    def _swap_experts(self, model: nn.Module, checkpoint: str | None) -> int:
        """The MoE layers' experts kept as integers too where the checkpoint stores them
        packed (`swap_int_experts`; with activation ordering, each expert's own input order)."""
        from engine.quantized_experts import swap_int_experts

        return swap_int_experts(model, self, checkpoint, self.bits, self.group, self.symmetric,
                                self.act_order)  # fmt: skip

    def pair(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        if self.layout == "awq":
            return pair_awq_weights(weights, self)
        if self.layout in GPTQ_LAYOUTS:
            return pair_gptq_weights(weights, self)
        return pair_int_weights(weights, self)

    @property
    def parts(self) -> tuple[str, ...]:
        """The checkpoint tensors a quantized layer's weight is stored as."""
        if self.layout in GPTQ_LAYOUTS:
            return GPTQ_PARTS
        return AWQ_PARTS if self.layout == "awq" else INT_PARTS

    def describe(self) -> str:
        groups = f"groups of {self.group}" if self.group else "per channel"
        zero = "symmetric" if self.symmetric else "with zero points"
        order = ", activation order" if self.act_order else ""
        return f"{self.bits}-bit ({groups}, {zero}{order})"


@dataclass(frozen=True)
class Int8Config:
    """A compressed-tensors "int-quantized" W8A8 checkpoint: int8 weights with a scale per
    output channel, activations quantized to int8 per token as they come (a checkpoint's
    static input scales are not used, as for FP8: per token is as precise or more)."""

    skip: tuple[str, ...] = ()
    checkpoint: bool = True
    layout: str = "w8a8"

    def swap(self, model: nn.Module, checkpoint: str | None = None) -> int:
        """The W8A8 layers swapped in, empty (meta model); a MoE's experts stored in int8
        are kept in 8 bits too, as W8A16 experts (`swap_int_experts`: the grouped GEMMs
        read the weights' integers and take 16-bit activations)."""
        from engine.layers.int8 import Int8Linear
        from engine.quantized_experts import swap_int_experts

        count = replace_linears(model, self, Int8Linear.like)
        return count + swap_int_experts(model, self, checkpoint, 8, None, True)

    def pair(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        return pair_int8_weights(weights)

    @property
    def parts(self) -> tuple[str, ...]:
        return ("weight_scale",)

    def describe(self) -> str:
        return "8-bit integer weights and activations (W8A8, per channel and per token)"


QuantConfig = Fp8Config | IntWeightConfig | Int8Config


def _w8a8_config(qc: dict, group: dict) -> Int8Config:
    """The W8A8 int scheme of a compressed-tensors config group that quantizes activations;
    ValueError, with the reason, for the ones it cannot run."""
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    if group.get("output_activations"):
        raise ValueError("compressed-tensors: quantized outputs are not supported")
    if a.get("type", "int") != "int" or w.get("type", "int") != "int":
        raise ValueError("compressed-tensors: quantized activations of type "
                         f"{a.get('type')!r} (FP8 schemes) are not supported; int8 W8A8 "
                         "and weight-only W4A16 / W8A16 are")  # fmt: skip
    if (w.get("num_bits"), a.get("num_bits")) != (8, 8):
        raise ValueError(f"compressed-tensors W{w.get('num_bits')}A{a.get('num_bits')}: "
                         "integer activations run with 8-bit weights and activations "
                         "(W8A8)")  # fmt: skip
    if not w.get("symmetric", True) or not a.get("symmetric", True):
        raise ValueError("compressed-tensors W8A8 with zero points (asymmetric weights or "
                         "activations) is not supported")  # fmt: skip
    if w.get("strategy") != "channel":
        raise ValueError(f"compressed-tensors W8A8 weight strategy {w.get('strategy')!r}: "
                         "'channel' is supported")  # fmt: skip
    if a.get("strategy", "token") not in ("token", "tensor"):
        raise ValueError(f"compressed-tensors W8A8 activation strategy {a.get('strategy')!r}: "
                         "per token (or a static tensor scale, run per token) is "
                         "supported")  # fmt: skip
    return Int8Config(tuple(qc.get("ignore") or ()))


def awq_config(qc: dict) -> IntWeightConfig:
    """The setup of an AutoAWQ checkpoint (`quant_method: "awq"`, its GEMM version: Qwen's
    and most `*-AWQ` models): 4-bit weights with a zero point per group, repacked as they
    load into the integer layers' layout; ValueError for the versions it cannot run."""
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r}: only the 'gemm' layout is supported")
    bits, group = qc.get("bits", qc.get("w_bit", 4)), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"AWQ with {bits}-bit weights: 4-bit is supported")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"AWQ group_size {group!r}: per-group checkpoints are supported")
    # (AutoAWQ leaves out every module whose name contains one of these)
    skip = tuple(f"re:.*{re.escape(m)}" for m in qc.get("modules_to_not_convert") or ())
    return IntWeightConfig(4, group, not qc.get("zero_point", True), skip, layout="awq")


GPTQ_LAYOUTS = ("gptq", "gptq_v2")


def gptq_config(qc: dict) -> IntWeightConfig:
    """The setup of a GPTQ checkpoint (`quant_method: "gptq"`: AutoGPTQ's and GPTQModel's,
    the `*-GPTQ-Int4` / `-Int8` models): 4- or 8-bit weights with a scale and zero point per
    group (or per channel, `group_size: -1`), `desc_act` (activation ordering: each column's
    group in a `g_idx`), repacked as they load; ValueError for what it cannot run."""
    bits, group = qc.get("bits"), qc.get("group_size", 128)
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits}-bit weights: 4- and 8-bit are supported")
    layout = str(qc.get("checkpoint_format") or "gptq").lower()
    if layout not in GPTQ_LAYOUTS:
        raise ValueError(f"GPTQ checkpoint_format {layout!r}: {GPTQ_LAYOUTS} are supported "
                         "(repacked kernels' formats, Marlin and others, are not)")  # fmt: skip
    if not isinstance(group, int) or not (group == -1 or group >= 1):
        raise ValueError(f"GPTQ group_size {group!r}: a group size, or -1 (per channel)")
    if qc.get("lm_head"):
        raise ValueError("GPTQ with a quantized LM head (lm_head: true) is not supported")
    skip = []
    for pattern, override in (qc.get("dynamic") or {}).items():
        if not pattern.startswith("-:"):  # (GPTQModel's per-module settings)
            raise ValueError(f"GPTQ dynamic override {pattern!r}: {override!r}: only the "
                             "'-:' entries (modules left unquantized) are supported")  # fmt: skip
        skip.append("re:" + pattern[2:])
    return IntWeightConfig(bits, None if group == -1 else group, bool(qc.get("sym", True)),
                           tuple(skip), layout=layout,
                           act_order=bool(qc.get("desc_act", False)))  # fmt: skip


def checkpoint_scheme(qc: dict | None) -> IntWeightConfig | Int8Config | None:
    """The integer-weight scheme of a config.json's `quantization_config` (None: none)."""
    method = (qc or {}).get("quant_method")
    if method == "compressed-tensors":
        return int_weight_config(qc)  # type: ignore[arg-type]
    if method == "gptq":
        return gptq_config(qc)  # type: ignore[arg-type]
    return awq_config(qc) if method == "awq" else None  # type: ignore[arg-type]


def int_weight_config(qc: dict) -> IntWeightConfig | Int8Config:
    """The W4A16 / W8A16 (or int8 W8A8) setup of a compressed-tensors `quantization_config`;
    ValueError, with the reason, for the schemes it cannot run."""
    groups = list((qc.get("config_groups") or {}).values())
    formats = {g.get("format") or qc.get("format") for g in groups}
    if len(groups) != 1 or "Linear" not in (groups[0].get("targets") or ()):
        raise ValueError("compressed-tensors: one config group targeting Linear layers is "
                         "supported (the W4A16 / W8A16 / W8A8 schemes)")  # fmt: skip
    group = groups[0]
    if formats == {"int-quantized"} and group.get("input_activations"):
        return _w8a8_config(qc, group)
    if formats != {"pack-quantized"}:
        raise ValueError(
            f"compressed-tensors format {sorted(map(str, formats))}: sluice runs "
            "'pack-quantized' checkpoints (W4A16 / W8A16 weights) and 'int-quantized' W8A8 "
            "ones"
        )
    w = group.get("weights") or {}
    if group.get("input_activations") or group.get("output_activations"):
        raise ValueError("compressed-tensors: quantized activations in a 'pack-quantized' "
                         "checkpoint are not supported; weight-only W4A16 / W8A16 are, and "
                         "int8 W8A8 in 'int-quantized' ones")  # fmt: skip
    if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
        raise ValueError(f"compressed-tensors weights of {w.get('num_bits')}-bit "
                         f"{w.get('type')}: 4- and 8-bit integers are supported")  # fmt: skip
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r}: 'group' and "
                         "'channel' are supported")  # fmt: skip
    if w.get("actorder") == "group":
        raise ValueError("compressed-tensors activation ordering (actorder 'group': a group "
                         "index per column) is not supported")  # fmt: skip
    size = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(size, int) or size < 1):
        raise ValueError(f"compressed-tensors group strategy without a group_size ({size!r})")
    return IntWeightConfig(int(w["num_bits"]), size, bool(w.get("symmetric", True)),
                           tuple(qc.get("ignore") or ()))  # fmt: skip


# quantization settings in a file of their own, for checkpoints whose config.json has none
# (AutoGPTQ's and early AutoAWQ's): the file -> the method it implies
_SIDECARS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def sidecar_quantization_config(path: str) -> dict | None:
    """A model folder's quantization settings from AutoGPTQ's `quantize_config.json` or
    AutoAWQ's `quant_config.json` (None: neither), its `quant_method` filled in."""
    import json
    import os

    for name, method in _SIDECARS.items():
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                qc = json.load(f)
            return {"quant_method": method, **qc}
    return None


def resolve_quantization(requested: str | None, hf_config: object) -> QuantConfig | None:
    """The quantization of `--quantization requested` on a model of `hf_config` (None:
    none): FP8 (a checkpoint's, or online), or a checkpoint's integer weights."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: {requested!r} not in {QUANTIZATION_METHODS}")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    method = (qc or {}).get("quant_method")
    if requested in CHECKPOINT_METHODS and requested != method:
        held = f"quantized with {method!r}" if method else "not quantized"
        raise ValueError(f"--quantization {requested}: the checkpoint is {held} (the flag "
                         "names the checkpoint's own method, or fp8 to quantize a 16-bit "
                         "one as it loads)")  # fmt: skip
    if not qc:
        return Fp8Config(checkpoint=False) if requested == "fp8" else None
    if method == "mxfp4" and getattr(hf_config, "model_type", None) == "gpt_oss":
        # gpt-oss's published experts: dequantized as they load (GptOssForCausalLM), run
        # in the model's dtype
        if requested is not None:
            raise ValueError(f"--quantization {requested} on an MXFP4 checkpoint")
        return None
    if method in CHECKPOINT_METHODS:
        if requested is not None and requested != method:
            raise ValueError(f"--quantization {requested} on a {method} checkpoint")
        return checkpoint_scheme(qc)
    if method != "fp8":
        raise ValueError(
            f"the checkpoint is quantized with {method!r}, which sluice does not run "
            f"(it runs FP8 checkpoints, quant_method 'fp8', --quantization fp8 on 16-bit "
            f"ones, compressed-tensors W4A16 / W8A16 ones, AWQ and GPTQ ones)"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 checkpoint format {qc['fmt']!r}: only e4m3 is supported")
    block = qc.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"quantization_config.weight_block_size {block!r}: expected [rows, cols]")
    skip = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
    return Fp8Config(checkpoint=True, block=tuple(block) if block else None, skip=skip)


def quantized_linear_names(model: nn.Module, config: QuantConfig) -> list[str]:
    """The linear layers to run quantized: those of the transformer blocks, less MoE routers
    and the modules the checkpoint leaves alone (names, suffixes, or "re:" patterns)."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not IN_BLOCK.search(name):
            continue
        if name.rsplit(".", 1)[-1] in _ROUTERS + getattr(model, "unquantized_linears", ()):
            continue
        if any(skipped(name, s) for s in config.skip):
            continue
        names.append(name)
    return names


def skipped(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.startswith(pattern + ".") or name.endswith("." + pattern)


def swap_in_fp8(model: nn.Module, config: Fp8Config) -> int:
    """Replace the layers of `quantized_linear_names` by `Fp8Linear`s: empty ones for a
    checkpoint to fill (the model still on the meta device), or the loaded weights quantized.
    Returns how many were replaced."""
    from engine.layers.fp8 import Fp8Linear

    make = Fp8Linear.like if config.checkpoint else Fp8Linear.quantize
    count = replace_linears(model, config, lambda linear: make(linear, config.block))
    if not config.checkpoint:
        from engine.quantized_experts import quantize_experts

        count += quantize_experts(model, config)
    if not config.checkpoint and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the 16-bit weights' memory goes to the KV pool
    return count


def replace_linears(
    model: nn.Module, config: QuantConfig, make: Callable[[nn.Module], nn.Module]
) -> int:
    """Replace each layer of `quantized_linear_names(model, config)` by `make(layer)`; how
    many."""
    names = quantized_linear_names(model, config)
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, make(getattr(owner, attr)))
    return len(names)
