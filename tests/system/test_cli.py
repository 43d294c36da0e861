"""The installed `sluice` console script, run as a user would: make a model, generate, fail.

Each command spends seconds importing torch and transformers, so independent commands run at
the same time: `--help` beside `make-tiny-model`, then both `generate` runs beside the
transformers load of the new folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# A bound for a hung process, not a timing: on a loaded 2-core machine a command takes ~10 s.
COMMAND_TIMEOUT_S = 120
SUBCOMMANDS = ("make-tiny-model", "generate", "router", "tokenizer", "worker", "detokenizer")


class Command:
    """One `sluice` process started in the background; ``result()`` waits for it."""

    def __init__(self, log_dir: Path, name: str, *args: str) -> None:
        script = Path(sysconfig.get_path("scripts")) / "sluice"
        assert script.exists(), f"{script} missing: install the package (pip install -e .)"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        env["HF_HUB_OFFLINE"] = "1"
        self.argv = [str(script), *args]
        self._out, self._err = log_dir / f"{name}.out", log_dir / f"{name}.err"
        with open(self._out, "w") as out, open(self._err, "w") as err:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=err, env=env)

    def result(self) -> subprocess.CompletedProcess[str]:
        try:
            code = self.proc.wait(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"{self.argv} ran past {COMMAND_TIMEOUT_S}s")
        return subprocess.CompletedProcess(
            self.argv, code, self._out.read_text(), self._err.read_text()
        )


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    return f"{proc.args} exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Command]]:
    """Every command of this module; those that need the model start once it is written."""
    tmp = tmp_path_factory.mktemp("cli")
    model_dir = str(tmp / "tiny-qwen3")
    started = {
        "help": Command(tmp, "help", "--help"),
        "make": Command(tmp, "make", "make-tiny-model", model_dir, "--arch", "qwen3"),
    }
    try:
        if started["make"].result().returncode == 0:
            gen = ("generate", "--model", model_dir)
            started["generate"] = Command(
                tmp, "generate", *gen, "--prompt", "Hello", "--max-new-tokens", "5", "--json"
            )
            started["page_size_0"] = Command(tmp, "page_size_0", *gen, "--page-size", "0")
        yield started
    finally:
        for command in started.values():
            if command.proc.poll() is None:
                command.proc.kill()
                command.proc.wait()


def model_run(runs: dict[str, Command], name: str) -> subprocess.CompletedProcess[str]:
    """The result of a command that needs the model folder (fails if it could not be made)."""
    if name not in runs:
        pytest.fail("make-tiny-model failed:\n" + describe(runs["make"].result()))
    return runs[name].result()


def test_help_lists_subcommands(runs: dict[str, Command]) -> None:
    proc = runs["help"].result()
    assert proc.returncode == 0, describe(proc)
    missing = [name for name in SUBCOMMANDS if name not in proc.stdout]
    assert not missing, f"--help does not list {missing}\n{proc.stdout}"


def test_make_tiny_model_writes_a_folder_transformers_loads(runs: dict[str, Command]) -> None:
    proc = runs["make"].result()
    assert proc.returncode == 0, describe(proc)
    model_dir = Path(proc.args[2])
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (model_dir / name).is_file(), f"{name} missing from {sorted(os.listdir(model_dir))}"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.model_type == "qwen3"
    assert len(tokenizer) == model.config.vocab_size
    input_ids = tokenizer("Hello, world", return_tensors="pt").input_ids
    assert tokenizer.decode(input_ids[0]) == "Hello, world"
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_generate_prints_json(runs: dict[str, Command]) -> None:
    proc = model_run(runs, "generate")
    assert proc.returncode == 0, describe(proc)
    outs = json.loads(proc.stdout)
    assert isinstance(outs, list) and len(outs) == 1, proc.stdout
    meta = outs[0]["meta_info"]
    finish = meta["finish_reason"]["type"]
    assert meta["completion_tokens"] == 5 or finish == "stop", meta
    assert len(outs[0]["output_ids"]) == meta["completion_tokens"]
    assert isinstance(outs[0]["text"], str)


def test_generate_rejects_page_size_zero(runs: dict[str, Command]) -> None:
    proc = model_run(runs, "page_size_0")
    assert proc.returncode == 2, describe(proc)
    assert "page_size" in proc.stderr, describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
