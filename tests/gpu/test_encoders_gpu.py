"""BERT and XLM-RoBERTa encoders on a GPU (engine/models/bert.py; attention padded per
batch there, one SDPA launch with the key mask): embeddings and a cross-encoder's logits
equal transformers' on the same GPU, in float32 and, within bfloat16's precision, in
bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from transformers import AutoModel, AutoModelForSequenceClassification  # noqa: E402

from engine.engine import Engine  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402
from tests.factories import tiny_model  # noqa: E402

QUERY = "where does the scheduler keep the requests"
DOCS = ["the scheduler keeps a waiting queue", "paris is in france", "你好 🙂", "x " * 300]


@torch.inference_mode()
def reference(path: str, labels: bool, dtype: torch.dtype) -> torch.Tensor:
    tok = load_tokenizer(path, padding_side="right")
    batch = tok([QUERY] * len(DOCS), DOCS, padding=True, truncation=True, max_length=512,
                return_tensors="pt", return_token_type_ids=True).to("cuda")  # fmt: skip
    if labels:
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
        return model.to("cuda")(**batch).logits.float().cpu()
    hidden = AutoModel.from_pretrained(path, dtype=dtype).to("cuda")(**batch).last_hidden_state
    return F.normalize(hidden[:, 0].float(), dim=-1).cpu()


@pytest.mark.parametrize("labels", [False, True])
@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_encoder_on_gpu_equals_transformers(arch: str, labels: bool, dtype: str, tol: float):
    path = tiny_model(arch, num_labels=1 if labels else None)
    tok = load_tokenizer(path)
    pairs = [tok(QUERY, d, truncation=True, max_length=512, return_token_type_ids=True)
             for d in DOCS]  # fmt: skip
    with Engine(model_path=path, device="cuda", dtype=dtype, skip_tokenizer_init=True) as engine:
        outs = engine.encode(input_ids=[p["input_ids"] for p in pairs],
                             token_type_ids=[p["token_type_ids"] for p in pairs])  # fmt: skip
    got = torch.tensor([o["embedding"] for o in outs])
    want = reference(path, labels, getattr(torch, dtype))
    assert (got - want).abs().max() < tol
