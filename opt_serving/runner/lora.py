"""LoRA adapters for the slot runner, on both sides of the stage interface (model/lora.py holds the math).

`StageLora` is a stage's share: its layers' stacked adapters on its devices (placed as its params are: split
like the layers they modify on a tensor-parallel mesh) and the jitted write of one adapter into one slot.

`Adapters` is the driver's registry (runner/slots.py owns one): the adapters served, by name, each read and
converted for every stage when it is added (`add`: any thread, so a server reads the files off the engine
thread), and which adapter each of the stages' `max_loras` slots holds. `acquire` (the engine thread) gives a
request's adapter a slot, pinned until the request lets it go (`release`): an adapter already in a slot keeps
it, another takes a free slot or the least recently used one no running request holds, and what must be
written there is returned for the caller to send to the stages (a device transfer between two steps, nothing
read or converted then). With every slot held by running requests, the request is refused (Overloaded: 429)
rather than queued.
"""
from __future__ import annotations

import collections
import threading
from typing import Optional

import jax
import numpy as np

from opt_serving.errors import InvalidRequest, NotFound, Overloaded
from opt_serving.model import lora as lora_model
from opt_serving.model import opt
from opt_serving.model.peft import LoraAdapter, read_peft


class StageLora:
    """A stage's stacked adapters (`weights`) for the layers of `stage` (model/opt.py's StageSpec), placed
    beside `params`, and what each step takes of them. With `config` None the stage has no adapters: every
    step takes None and traces no LoRA at all."""

    def __init__(self, cfg, config: Optional[lora_model.LoraConfig], stage, params: dict):
        self.cfg, self.layout, self.weights = cfg, None, None
        self.seq_adapter = -1  # the adapter generate()'s rows use (set's for_generate)
        if config is None:
            return
        self.layout = config.layout(stage.start, stage.stop, opt.is_fused(params), opt.param_dtype(params))
        mesh = _mesh(params)
        if mesh is not None:
            self.weights = lora_model.stack(cfg, self.layout, lora_model.shardings(cfg, self.layout, mesh))
        else:
            device = {d for x in jax.tree_util.tree_leaves(params) if hasattr(x, "sharding")
                      for d in x.sharding.device_set}
            self.weights = jax.device_put(lora_model.stack(cfg, self.layout), next(iter(device), None))
        self._set = jax.jit(lora_model.set_slot, donate_argnums=(0,))

    def set(self, slot: int, part: dict, for_generate: bool = False) -> None:
        """Slot `slot` holds `part` (lora_model.slot_part's for this stage) from the next step on;
        `for_generate`: generate()'s rows use it (a notebook's model with one adapter)."""
        if self.layout is None:
            raise ValueError("this model was loaded without LoRA adapters")
        self.weights = self._set(self.weights, np.int32(slot), part)
        if for_generate:
            self.seq_adapter = slot

    def warm(self) -> None:
        """Compile the write into a slot (warm-up's: an adapter loaded while serving compiles nothing), writing
        slot 0's own numbers back."""
        if self.layout is not None:
            self.set(0, jax.tree_util.tree_map(lambda w: np.asarray(w[0]), self.weights))

    def batch(self, index, rows: int, ragged: bool = False) -> Optional[lora_model.Lora]:
        """What a step of `rows` rows takes, their adapters `index` (int32 [rows], -1: none; None: none).
        `ragged`: the step is steps.ragged_step, whose rows are one sequence of tokens ([1, rows])."""
        if self.layout is None:
            return None
        index = np.full(rows, -1, np.int32) if index is None else np.asarray(index, np.int32)
        return lora_model.Lora(self.weights, index[None] if ragged else index)

    def joining(self, index, rows: int, join) -> Optional[lora_model.Lora]:
        """`batch` of a step with prompts joining (runner.types.JoinBlock): the rows' adapters, then each
        joining token's, per token [1, rows + T]."""
        if self.layout is None:
            return None
        tokens = np.full(len(join.ids), -1, np.int32) if join.adapters is None else join.adapters
        rows_index = np.full(rows, -1, np.int32) if index is None else np.asarray(index, np.int32)
        return lora_model.Lora(self.weights, np.concatenate([rows_index, tokens])[None])

    def packed(self, tokens) -> Optional[lora_model.Lora]:
        """`batch` of a step whose tokens are one list (runner.types.PackedTokens): each token's adapter, [1, N]."""
        if self.layout is None:
            return None
        index = np.full(len(tokens.ids), -1, np.int32) if tokens.adapters is None else tokens.adapters
        return lora_model.Lora(self.weights, np.asarray(index, np.int32)[None])

    def generating(self, rows: int) -> Optional[lora_model.Lora]:
        """`batch` of generate()'s rows: each uses the generate() adapter (or none)."""
        return self.batch(np.full(rows, self.seq_adapter, np.int32), rows)


def _mesh(params: dict):
    """The mesh a tensor-parallel stage's params are sharded on; None on one device."""
    for x in jax.tree_util.tree_leaves(params):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if mesh is not None and mesh.devices.size > 1:
            return mesh
    return None


class _Entry:
    """A registered adapter: read, and converted for each stage."""

    def __init__(self, name: str, adapter: LoraAdapter, parts: list):
        self.name, self.adapter, self.parts = name, adapter, parts


class Adapters:
    """The served adapters and the stages' slots (see the module docstring). `layouts`: each stage's."""

    def __init__(self, cfg, layouts: list):
        self.cfg, self.layouts = cfg, list(layouts)
        self.slots = self.layouts[0].slots
        self._lock = threading.Lock()
        self._named: dict[str, _Entry] = {}
        self._held: list[Optional[_Entry]] = [None] * self.slots  # what each slot holds
        self._pins = [0] * self.slots
        self._recent: collections.OrderedDict[int, None] = collections.OrderedDict((s, None) for s in range(self.slots))

    # ---- the registry (any thread) ----
    def read(self, path) -> LoraAdapter:
        """The adapter at `path`, read and checked against the model and the slots (model.peft.AdapterError)."""
        adapter = read_peft(path, self.cfg)
        self.layouts[0].check(adapter)
        return adapter

    def add(self, name: str, path) -> LoraAdapter:
        """Serve the adapter at `path` as `name` (read and converted here, in the calling thread)."""
        if not isinstance(name, str) or not name:
            raise InvalidRequest("a LoRA adapter needs a non-empty name", param="lora_name")
        with self._lock:
            if name in self._named:
                raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        adapter = self.read(path)
        parts = [lora_model.slot_part(adapter, self.cfg, layout) for layout in self.layouts]
        with self._lock:
            if name in self._named:
                raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            self._named[name] = _Entry(name, adapter, parts)
        return adapter

    def remove(self, name: str) -> None:
        """Serve `name` no more; requests running with it finish with it (its slot is reused after them)."""
        with self._lock:
            if self._named.pop(name, None) is None:
                raise NotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name",
                               code="model_not_found")

    def names(self) -> list[str]:
        with self._lock:
            return list(self._named)

    def adapter(self, name: str) -> Optional[LoraAdapter]:
        with self._lock:
            entry = self._named.get(name)
        return None if entry is None else entry.adapter

    def salt(self, name: Optional[str]) -> bytes:
        """The prefix cache's key start for prompts of adapter `name`: its fingerprint (the same weights share
        their cached prefixes; another adapter's, or the base model's, never match)."""
        if name is None:
            return b""
        entry = self._named.get(name)
        return b"lora:" + (entry.adapter.fingerprint if entry is not None else b"?" + name.encode())

    # ---- the slots (the engine thread) ----
    def acquire(self, name: str) -> tuple[int, Optional[list]]:
        """A slot for `name`, pinned -> (slot, None) where it holds the adapter already, or (slot, each stage's
        part to write there first). NotFound for a name not served; Overloaded when every slot is held."""
        with self._lock:
            entry = self._named.get(name)
            if entry is None:
                raise NotFound(f"The model `{name}` does not exist.", param="model", code="model_not_found")
            slot = next((s for s, e in enumerate(self._held) if e is entry), None)
            write = slot is None
            if write:
                slot = next((s for s in self._recent if self._pins[s] == 0), None)
                if slot is None:
                    raise Overloaded(f"all {self.slots} LoRA adapter slots (--max-loras) are held by running "
                                     f"requests of other adapters; {name} cannot start now")
                self._held[slot] = entry
            self._pins[slot] += 1
            self._recent.move_to_end(slot)
            return slot, entry.parts if write else None

    def can_acquire(self, name: str) -> bool:
        """Whether `acquire(name)` would give a slot now."""
        with self._lock:
            entry = self._named.get(name)
            return entry is not None and any(e is entry or p == 0 for e, p in zip(self._held, self._pins))

    def pin(self, slot: int) -> None:
        """One more holder of a slot already held."""
        with self._lock:
            self._pins[slot] += 1

    def release(self, slot: int) -> None:
        with self._lock:
            self._pins[slot] -= 1

    def resident(self) -> dict[str, int]:
        """Served adapters in a slot: name -> slot."""
        with self._lock:
            return {e.name: s for s, e in enumerate(self._held) if e is not None and self._named.get(e.name) is e}


class SlotAdapters:
    """The slot runner's side (runner/slots.py): which adapter each decode slot's request (`of_slot`) and each
    prefilled request not yet in a slot (by its handle) uses, each pinned in `registry` until it is let go, and
    the stage writes that put an adapter in its slot. `registry` None: a model without adapters (`on` False:
    the steps take no adapter indices)."""

    def __init__(self, stages, num_slots: int, registry: Optional[Adapters]):
        self.stages, self.registry = stages, registry
        self.of_slot = np.full(num_slots, -1, np.int32)
        self._held: dict[int, int] = {}  # handle -> adapter slot, pinned

    @property
    def on(self) -> bool:
        return self.registry is not None

    def take(self, settings) -> int:
        """The adapter slot of a request's adapter (`settings.lora`), pinned; -1 for the base model. Puts the
        adapter in its slot on every stage first where it is not there yet."""
        if settings.lora is None:
            return -1
        if self.registry is None:
            raise NotFound(f"The model `{settings.lora}` does not exist (this model serves no LoRA adapters).",
                           param="model", code="model_not_found")
        slot, parts = self.registry.acquire(settings.lora)
        if parts is not None:
            try:
                self.stages.get([self.stages.call(i, "set_lora", slot, parts[i]) for i in range(self.stages.n)])
            except BaseException:
                self.registry.release(slot)
                raise
        return slot

    def can_take(self, settings) -> bool:
        return settings.lora is None or (self.registry is not None and self.registry.can_acquire(settings.lora))

    def hold(self, handle: int, settings) -> int:
        """`take` for a request being prefilled under `handle` -> its adapter slot."""
        index = self._held[handle] = self.take(settings)
        return index

    def held(self, handle: int) -> int:
        return self._held.get(handle, -1)

    def insert(self, handle: int, slot: int, keep: bool = False) -> None:
        """The request prefilled under `handle` goes into decode slot `slot` (with `keep`, warm-up's, its handle
        keeps the pin)."""
        index = self.of_slot[slot] = self._held.get(handle, -1) if keep else self._held.pop(handle, -1)
        if keep and index >= 0:  # the slot's own pin, let go by free
            self.registry.pin(index)

    def drop(self, handle: int) -> None:
        """A prefilled request that will not be inserted lets its adapter go."""
        self._let_go(self._held.pop(handle, -1))

    def free(self, slot: int) -> None:
        self._let_go(int(self.of_slot[slot]))
        self.of_slot[slot] = -1

    def rows(self, slots) -> Optional[np.ndarray]:
        """The adapters of decode slots `slots` for a step (None without adapters)."""
        return self.of_slot[slots] if self.on else None

    def pass_rows(self, indices, rows: int) -> Optional[np.ndarray]:
        """A prefill pass's adapters: these, then -1 up to `rows` (None without adapters)."""
        if not self.on:
            return None
        out = np.full(rows, -1, np.int32)
        out[:len(indices)] = indices
        return out

    def salt(self, settings) -> bytes:
        """Where a prompt's prefix-cache keys start (Adapters.salt): its adapter's weights are part of them."""
        return b"" if self.registry is None else self.registry.salt(settings.lora)

    def _let_go(self, index: int) -> None:
        if index >= 0:
            self.registry.release(index)
