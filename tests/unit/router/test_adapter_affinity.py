"""`adapter_affinity`: which ranks a request naming a LoRA adapter may go to."""

from __future__ import annotations

from berth_router.proxy import RESIDENT_SLACK, adapter_affinity
from berth_router.workers import HealthState, LoadSnapshot, Worker


def worker(
    rank: int, load: int, adapters: set[str], resident: frozenset[str] | set[str] = frozenset()
) -> Worker:
    snap = LoadSnapshot(
        requests=load,
        running=load,
        waiting=0,
        token_usage=0.0,
        received=0.0,
        own_requests=0,
        adapters=frozenset(adapters),
        resident=frozenset(resident),
    )
    return Worker(rank, f"http://r{rank}", HealthState(), load_snapshot=snap)


def load_of(w: Worker) -> float:
    assert w.load_snapshot is not None
    return float(w.load_snapshot.requests)


def ranks(workers: list[Worker]) -> list[int]:
    return [w.rank for w in workers]


def test_only_ranks_serving_the_adapter_and_resident_ones_first():
    pool = [worker(0, 0, set()), worker(1, 3, {"a"}), worker(2, 1, {"a"}, {"a"})]
    chosen, decision = adapter_affinity("a", pool, load_of)
    assert ranks(chosen) == [2] and decision == "lora_resident"
    # BASE:NAME names the same adapter.
    assert ranks(adapter_affinity("base:a", pool, load_of)[0]) == [2]


def test_a_busy_resident_rank_gives_way_to_a_rank_that_only_serves_it():
    pool = [worker(1, 0, {"a"}), worker(2, RESIDENT_SLACK + 1, {"a"}, {"a"})]
    chosen, decision = adapter_affinity("a", pool, load_of)
    assert ranks(chosen) == [1, 2] and decision == "lora_loaded"
    pool = [worker(1, 0, {"a"}), worker(2, RESIDENT_SLACK, {"a"}, {"a"})]
    assert ranks(adapter_affinity("a", pool, load_of)[0]) == [2]


def test_the_base_model_and_unknown_names_keep_every_candidate():
    pool = [worker(0, 0, set()), worker(1, 0, {"a"})]
    assert adapter_affinity(None, pool, load_of) == (pool, None)
    assert adapter_affinity("base", pool, load_of) == (pool, None)
    assert adapter_affinity("nope", pool, load_of) == (pool, None)
