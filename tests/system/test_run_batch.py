"""`sluice run-batch` (services/run_batch.py) as a user runs it: one deployment started for a
file mixing chat and completion lines, a refused line, and a group that fails validation;
the results in input order; an unreadable file refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.factories import tiny_model

REPO = Path(__file__).resolve().parents[2]


def run(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "services.cli", "run-batch", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout_s)  # fmt: skip


def test_run_batch_writes_every_result_in_input_order(tmp_path: Path) -> None:
    model = tiny_model("llama")
    name = os.path.basename(model)
    chat = lambda cid, text, **kw: {"custom_id": cid, "method": "POST",  # noqa: E731
                                    "url": "/v1/chat/completions", "body": {"model": name,
                                    "messages": [{"role": "user", "content": text}],
                                    "max_tokens": 5, "temperature": 0, **kw}}  # fmt: skip
    complete = lambda cid: {"custom_id": cid, "method": "POST", "url": "/v1/completions",  # noqa: E731
                         "body": {"model": name, "prompt": "x", "max_tokens": 2}}  # fmt: skip
    lines = [chat("a", "Hello"), chat("b", "Hi", max_tokens=-1), chat("c", "Bonjour", n=2),
             complete("d"), complete("d")]  # fmt: skip  (d twice: that group fails validation)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    done = run("-i", str(src), "-o", str(out), "--model", model, "--max-total-tokens", "4096")
    assert done.returncode == 1, done.stderr[-3000:]  # the completions group failed
    assert "/v1/chat/completions: completed, 2 completed, 1 failed" in done.stderr
    assert "/v1/completions: failed" in done.stderr and "line 2:" in done.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", "b", "c"]
    a, b, c = (r["response"] for r in results)
    assert a["status_code"] == 200 and a["body"]["usage"]["completion_tokens"] == 5
    assert b["status_code"] == 400 and b["body"]["error"]["param"] == "max_tokens"
    assert [ch["index"] for ch in c["body"]["choices"]] == [0, 1]


def test_an_unreadable_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "url": "/v1/chat/completions"}\n{oops\n')
    done = run("-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--model", "/nonexistent",
               timeout_s=60)  # fmt: skip
    assert done.returncode == 2 and f"{src}:2: not JSON" in done.stderr
    src.write_text('{"custom_id": "a", "url": "/v1/models"}\n')
    done = run("-i", str(src), "-o", str(tmp_path / "out.jsonl"), timeout_s=60)
    assert done.returncode == 2 and f"{src}:1: url must be one of" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()
