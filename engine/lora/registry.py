"""`LoRARegistry`: the adapter names a scheduler serves, and their ids, as adapters are loaded
and unloaded while it runs (vLLM's `/v1/load_lora_adapter`, SGLang's `/load_lora_adapter`).

Ids are never reused: the prefix cache keys K/V by adapter id (`Req.cache_namespace`), so an
adapter loaded again under the same name (new weights, perhaps) starts with nothing cached,
and entries of an unloaded one are only reachable by nobody and age out of the cache.

Unloading takes the name away at once (a new request naming it is refused), while requests
already admitted finish on the adapter; its id *drains* until none of them is left, and only
then are its weights dropped (`release`). Replacing an adapter in place (vLLM's
`load_inplace`) is a load under a taken name: the name moves to the new id, the old one drains.
"""

from __future__ import annotations

from engine.lora.adapter import AdapterSpec, read_adapter_spec


class LoRARegistry:
    def __init__(self, specs: list[AdapterSpec], enabled: bool, max_rank: int | None) -> None:
        self.enabled = enabled
        self.max_rank = max_rank  # the device slots' (None without LoRA)
        self.ids: dict[str, int] = {s.name: s.id for s in specs}  # name -> id, served now
        self.paths: dict[str, str] = {s.name: s.path for s in specs}
        self.draining: set[int] = set()  # unloaded or replaced, requests of it still running
        self._next_id = max((s.id for s in specs), default=0) + 1

    def prepare(self, name: str, path: str, replace: bool = False) -> AdapterSpec:
        """The spec of an adapter to load as `name` (a fresh id); ValueError with the reason
        if it cannot be: LoRA off, an empty or taken name (unless `replace`), a folder that is
        not a LoRA this engine serves, a rank above the slots'."""
        if not self.enabled:
            raise ValueError("LoRA is not enabled on this engine (start it with --enable-lora "
                             "or --lora-paths)")  # fmt: skip
        if not name or not name.strip() or not path:
            raise ValueError("lora_name and lora_path must not be empty")
        if name in self.ids and not replace:
            raise ValueError(
                f"the LoRA adapter {name!r} is already loaded (from {self.paths[name]}); "
                "unload it first, or replace it in place"
            )
        spec = read_adapter_spec(self._next_id, name, path)
        assert self.max_rank is not None
        if spec.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {name!r}: rank {spec.rank} > max_lora_rank "
                             f"{self.max_rank} (the slots' rank, fixed at start: "
                             "--max-lora-rank)")  # fmt: skip
        self._next_id += 1
        return spec

    def commit(self, spec: AdapterSpec) -> None:
        """Serve `spec` under its name (once the device has it); a replaced one drains."""
        old = self.ids.get(spec.name)
        if old is not None:
            self.draining.add(old)
        self.ids[spec.name] = spec.id
        self.paths[spec.name] = spec.path

    def remove(self, name: str) -> int:
        """Stop serving `name`; its id drains. ValueError if no adapter has that name."""
        if name not in self.ids:
            served = sorted(self.ids) or "none"
            raise ValueError(f"the LoRA adapter {name!r} is not loaded (served: {served})")
        adapter_id = self.ids.pop(name)
        del self.paths[name]
        self.draining.add(adapter_id)
        return adapter_id

    def release(self, in_use: set[int]) -> list[int]:
        """The draining ids no request uses any more (no longer draining: drop them)."""
        done = sorted(self.draining - in_use)
        self.draining.difference_update(done)
        return done
