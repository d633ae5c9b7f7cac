"""LoraManager (scheduler process): the adapters loaded in host memory, which of them a step may
run together, the device slots they take, and unloading once their requests are done."""

from __future__ import annotations

import itertools
import json
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from berth_runtime.lora.adapter import LoraAdapter, LoraError, read_adapter
from berth_runtime.lora.pool import LoraPool, attach
from berth_runtime.model_executor import tensor_parallel
from berth_runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

# --max-lora-rank's default when no adapter is given at start (vLLM's default too).
DEFAULT_MAX_RANK = 16


@dataclass
class Loaded:
    """An adapter this scheduler serves; `namespace`: its part of the prefix cache, new on every
    load, so that a reloaded adapter of the same name never reuses the old one's cached K/V."""

    adapter: LoraAdapter
    namespace: int
    unloading: bool = False


class LoraManager:
    """Adapters by name, each in host memory once loaded (at most --max-loaded-loras), and a
    LoraPool of --max-loras-per-batch device slots that the running requests' adapters occupy."""

    def __init__(
        self,
        args: ServerArgs,
        model: nn.Module,
        device: torch.device,
        packed: bool,
        triton: bool = False,
    ) -> None:
        self.model = model
        self.max_loaded = args.max_loaded_loras
        self.loaded: dict[str, Loaded] = {}
        self._namespaces = itertools.count(1)
        # Tensor parallelism: process 0 (the scheduler) repeats every load, step and drop on the
        # other processes (`tp_worker.serve`), so each holds its share of the same slots.
        tp = tensor_parallel.current()
        self.leader = tp.size > 1 and tp.rank == 0
        initial = [parse_lora_path(spec) for spec in args.lora_paths]
        self.max_rank = args.max_lora_rank or max(
            [DEFAULT_MAX_RANK, *(peek_rank(path) for _, path in initial)]
        )
        dtype = next(model.parameters()).dtype
        self.pool = LoraPool(
            args.max_loras_per_batch, self.max_rank, device, dtype, packed, triton=triton
        )
        attach(model, self.pool)
        for name, path in initial:  # every process loads these itself
            self._load(name, path)

    @property
    def max_per_batch(self) -> int:
        return self.pool.num_slots

    def slots_nbytes(self) -> int:
        """Device memory the slots take (`LoraPool`'s stacks): what the KV cache must leave free
        on an accelerator."""
        return sum(s.a.nbytes + s.b.nbytes for s in self.pool.stacks.values())

    # --- loading -------------------------------------------------------------------------------

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read an adapter into host memory; LoraError (400) if it cannot be served, (409) if
        the name is taken, (400) past --max-loaded-loras."""
        adapter = self._load(name, path)
        if self.leader:
            tensor_parallel.broadcast(("lora_load", (name, path)))
        return adapter

    def _load(self, name: str, path: str) -> LoraAdapter:
        if not name or ":" in name:
            raise LoraError(f"adapter name {name!r} must be non-empty and have no ':'")
        if name in self.loaded:
            raise LoraError(f"an adapter named {name!r} is loaded already; unload it first", 409)
        if self.max_loaded is not None and len(self.loaded) >= self.max_loaded:
            raise LoraError(
                f"{len(self.loaded)} adapters are loaded, the most this server holds "
                "(--max-loaded-loras); unload one first"
            )
        with torch.inference_mode():
            adapter = read_adapter(name, path, self.model, self.max_rank)
        self.loaded[name] = Loaded(adapter, next(self._namespaces))
        logger.info(
            "Loaded LoRA adapter %r from %s (rank %d, %.1f MB)",
            name,
            path,
            adapter.rank,
            adapter.nbytes / 2**20,
        )
        return adapter

    def serves(self, name: str) -> bool:
        """Whether new requests may use `name` (loaded, and not being unloaded)."""
        loaded = self.loaded.get(name)
        return loaded is not None and not loaded.unloading

    def namespace(self, name: str) -> int:
        return self.loaded[name].namespace

    def start_unload(self, name: str) -> None:
        """New requests for `name` are refused from now; it goes once its requests are done
        (`finish_unloads`). LoraError (404) if it is not loaded."""
        if not self.serves(name):
            raise LoraError(f"no LoRA adapter named {name!r} is loaded", 404)
        self.loaded[name].unloading = True

    def finish_unloads(self, in_use: set[str]) -> list[tuple[str, int]]:
        """Drop the adapters being unloaded that no request uses any more; returns each one's
        (name, prefix-cache namespace), for the caller to drop its cached K/V."""
        done = [n for n, a in self.loaded.items() if a.unloading and n not in in_use]
        dropped = []
        for name in done:
            dropped.append((name, self.loaded[name].namespace))
            self.drop(name)
        return dropped

    def drop(self, name: str) -> None:
        """Forget an adapter no request uses (on every process)."""
        if self.leader:
            tensor_parallel.broadcast(("lora_drop", name))
        self.pool.evict(name)
        self.loaded.pop(name, None)
        logger.info("Unloaded LoRA adapter %r", name)

    def paths(self) -> dict[str, str]:
        """Each loaded adapter's directory, by name."""
        return {name: loaded.adapter.path for name, loaded in self.loaded.items()}

    # --- a step --------------------------------------------------------------------------------

    def may_join(self, name: str | None, live: set[str]) -> bool:
        """Whether a request for adapter `name` may run beside requests using the adapters in
        `live`: one batch holds at most --max-loras-per-batch adapters (the base needs none)."""
        return name is None or name in live or len(live) < self.pool.num_slots

    def prepare(self, adapters: list[str | None], rows: list[int], live: set[str]) -> None:
        """Put the step's adapters in slots (keeping those of `live` requests) and tell the
        projections which rows take which (see `LoraPool.set_batch`)."""
        if not any(adapters) and not self.pool.active:
            return  # a base-only step after another: nothing to change, nothing to broadcast
        if self.leader:
            tensor_parallel.broadcast(("lora_prepare", (adapters, rows, live)))
        keep = live | {name for name in adapters if name is not None}
        for name in dict.fromkeys(a for a in adapters if a is not None):
            self.pool.fill(self.loaded[name].adapter, keep)
        self.pool.set_batch(adapters, rows)


def parse_lora_path(spec: str) -> tuple[str, str]:
    """`NAME=PATH`, or a bare PATH named by its last directory (as SGLang's --lora-paths)."""
    name, sep, path = spec.partition("=")
    if not sep:
        path = spec
        name = path.rstrip("/").rsplit("/", 1)[-1]
    return name, path


def peek_rank(path: str) -> int:
    """An adapter directory's rank, from its config alone (0 when unreadable: the load says why)."""
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            return int(json.load(f).get("r", 0))
    except (OSError, ValueError, TypeError):
        return 0
