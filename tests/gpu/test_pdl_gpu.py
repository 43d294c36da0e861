"""--enable-pdl on the GPU: the Triton kernels launched as programmatic dependent launches
(kernels.jit.use_pdl), each free to start while the kernel before it finishes and waiting for
it in its first instruction. What it may change is when the kernels run, never what they
compute, so the engine's greedy tokens must equal those of plain launches exactly: bf16, CUDA
graphs, the overlap loop, on the default path (Triton kernels between cuBLAS GEMMs), on the
Triton GEMV (a chain of Triton kernels only) and GPT-2 (the decode kernel storing K/V and
merging its splits through counters). The CPU tests check the order inside each kernel
(tests/unit/test_decode_launches.py, tests/unit/test_kernels_compile.py); this checks the
device honours it, over thousands of launches.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.factories import require_compiled_cuda  # noqa: E402

require_compiled_cuda()

from engine.config import ModelConfig  # noqa: E402
from kernels.jit import pdl_on, pdl_supported  # noqa: E402
from tests.factories import mixed_prompts, tiny_model  # noqa: E402


def test_the_device_supports_pdl():
    major, minor = torch.cuda.get_device_capability()
    assert pdl_supported(torch.device("cuda")) == (major >= 9), (major, minor)


@pytest.mark.parametrize("dtype, want", [("bfloat16", True), ("float32", False)])
def test_by_default_with_the_gemv_on_16_bit_models(dtype, want):
    """No flag: a 16-bit model on CUDA decodes on the Triton GEMV (gemv_backend auto) and,
    on Hopper, with PDL; a float32 one on cuBLAS without PDL."""
    from engine.engine import Engine

    engine = Engine(model_path=tiny_model("llama"), device="cuda", dtype=dtype,
                    max_total_tokens=4096, disable_cuda_graph=True, skip_tokenizer_init=True)
    try:
        assert pdl_on() == (want and pdl_supported(torch.device("cuda")))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch, extra", [
    ("llama", {"gemv_backend": "torch"}), ("llama", {}), ("gpt2", {}),
])  # fmt: skip
def test_engine_greedy_tokens_with_and_without_pdl(arch, extra):
    """16 requests of 16 to 61 tokens, the batch shrinking from 16 rows to 1 as they finish
    (a graph per size): the same greedy tokens with and without PDL."""
    from engine.engine import Engine

    if not pdl_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    path = tiny_model(arch)
    prompts = mixed_prompts(ModelConfig.from_pretrained(path).vocab_size, n=16, max_len=200)
    params = [{"max_new_tokens": 16 + 3 * i, "temperature": 0, "ignore_eos": True}
              for i in range(len(prompts))]  # fmt: skip

    def generate(pdl: bool) -> list[list[int]]:
        engine = Engine(model_path=path, device="cuda", dtype="bfloat16",
                        attention_backend="triton", max_total_tokens=16384,
                        cuda_graph_bs=(1, 2, 4, 8, 16), skip_tokenizer_init=True,
                        enable_pdl=pdl, **extra)  # fmt: skip
        assert pdl_on() == pdl
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        engine.shutdown()
        return [o["output_ids"] for o in outs]

    want = generate(pdl=False)
    got = generate(pdl=True)
    assert got == want
