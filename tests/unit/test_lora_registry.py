"""LoRARegistry: the names a running scheduler serves as adapters are loaded, replaced and
unloaded; ids are never reused; an unloaded or replaced adapter drains until no request
uses it; what cannot be loaded is refused with the reason, changing nothing."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from engine.lora import read_adapter_specs
from engine.lora.registry import LoRARegistry
from tests.factories import tiny_lora, tiny_model


@pytest.fixture(scope="module")
def folders() -> dict[str, str]:
    path = tiny_model("llama")
    return {"r8": tiny_lora(path, 1, 8), "r4": tiny_lora(path, 2, 4), "r16": tiny_lora(path, 3, 16)}


def test_load_replace_unload_and_drain(folders) -> None:
    reg = LoRARegistry(read_adapter_specs([f"a={folders['r8']}"]), enabled=True, max_rank=8)
    assert reg.ids == {"a": 1}
    b = reg.prepare("b", folders["r4"])
    assert (b.id, b.name, b.rank) == (2, "b", 4) and "b" not in reg.ids  # not served yet
    reg.commit(b)
    assert reg.ids == {"a": 1, "b": 2} and reg.paths["b"] == folders["r4"]
    with pytest.raises(ValueError, match="'a' is already loaded .*unload it first"):
        reg.prepare("a", folders["r4"])
    a2 = reg.prepare("a", folders["r4"], replace=True)
    reg.commit(a2)
    assert reg.ids == {"a": 3, "b": 2} and reg.draining == {1}
    assert reg.remove("b") == 2 and reg.ids == {"a": 3} and "b" not in reg.paths
    assert reg.draining == {1, 2}
    assert reg.release(in_use={2, 3}) == [1] and reg.draining == {2}
    assert reg.release(in_use={2}) == [] and reg.release(in_use=set()) == [2]
    assert not reg.draining
    again = reg.prepare("b", folders["r4"])
    assert again.id == 4  # never a drained adapter's id: the prefix cache keys K/V by id


def test_what_cannot_be_loaded_is_refused(folders, tmp_path) -> None:
    off = LoRARegistry([], enabled=False, max_rank=None)
    with pytest.raises(ValueError, match="not enabled.*--enable-lora"):
        off.prepare("a", folders["r8"])
    reg = LoRARegistry([], enabled=True, max_rank=8)
    with pytest.raises(ValueError, match="rank 16 > max_lora_rank 8.*--max-lora-rank"):
        reg.prepare("big", folders["r16"])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        reg.prepare("gone", str(tmp_path / "nothing"))
    dora = tmp_path / "dora"
    shutil.copytree(folders["r4"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        reg.prepare("dora", str(dora))
    for name, path in (("", folders["r4"]), (" ", folders["r4"]), ("x", "")):
        with pytest.raises(ValueError, match="must not be empty"):
            reg.prepare(name, path)
    with pytest.raises(ValueError, match=r"'x' is not loaded \(served: none\)"):
        reg.remove("x")
    assert reg.ids == {} and not reg.draining
    assert reg.prepare("ok", folders["r4"]).id == 1  # refusals took no id
    assert os.path.isdir(folders["r4"])
