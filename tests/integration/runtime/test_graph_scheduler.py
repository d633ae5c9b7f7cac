"""The scheduler driving the embedded model through the decode graph runner (its eager replay on
CPU) gives every request what it gives without it: the same tokens and logprobs, for greedy
requests (whose tokens come from the step's own argmax), greedy ones asking for logprobs, and
seeded sampled ones, while the batch shrinks through the buckets 16, 8, 4, 2 and 1."""

from __future__ import annotations

import pytest

from berth_runtime.io_struct import TokenizedGenerateReqInput
from berth_runtime.managers.scheduler import Scheduler
from berth_runtime.model_executor.cuda_graph_runner import DecodeGraphRunner
from berth_runtime.sampling_params import SamplingParams
from berth_runtime.server_args import ServerArgs
from tests.integration.runtime.engine_steps import load_runner

MAX_BS = 16
SETTINGS = {"max_total_tokens": 4096, "max_running_requests": MAX_BS, "disable_radix_cache": True}


def requests() -> list[TokenizedGenerateReqInput]:
    """Eleven requests of different lengths: greedy with logprobs and seeded sampling, then the
    three longest plain greedy (alone in the last steps, they take the step's argmax)."""
    out = []
    for i in range(11):
        prompt = [1, *(7 + (13 * i + j) % 900 for j in range(4 + 3 * i))]
        kind = "greedy" if i >= 8 else ("logprobs", "sampled")[i % 2]
        params = SamplingParams(
            max_new_tokens=3 + 2 * i,
            temperature=0.8 if kind == "sampled" else 0.0,
            seed=100 + i if kind == "sampled" else None,
            ignore_eos=True,
        ).normalized()
        out.append(
            TokenizedGenerateReqInput(
                rid=f"{kind}-{i}",
                input_ids=prompt,
                sampling_params=params,
                return_logprob=kind == "logprobs",
                top_logprobs_num=2 if kind == "logprobs" else 0,
            )
        )
    return out


def serve(runner, graphs: DecodeGraphRunner | None) -> tuple[dict, list[int]]:
    """Every request's tokens and logprobs; the decode batch sizes the graph runner saw."""
    runner.graph_runner = graphs
    runner.kv_pool.clear()
    sizes: list[int] = []
    if graphs is not None:
        run = graphs.run
        graphs.run = lambda ids, *rest: sizes.append(len(ids)) or run(ids, *rest)
    scheduler = Scheduler(ServerArgs(**SETTINGS), runner, eos_token_ids={2}, decode=str)
    for request in requests():
        scheduler.handle_generate(request)
    results: dict[str, dict] = {}
    for _ in range(500):
        if scheduler.is_idle:
            return results, sizes
        out = scheduler.step()
        for o in out.outputs if out else []:
            entry = results.setdefault(o.rid, {"ids": [], "logprobs": []})
            entry["ids"] += o.new_token_ids
            entry["logprobs"] += o.output_token_logprobs or []
    raise AssertionError("the scheduler did not finish")


@pytest.fixture(scope="module")
def runner():
    return load_runner(**SETTINGS)


def test_graph_runner_steps_equal_the_plain_decode_steps(runner):
    plain, _ = serve(runner, None)
    table = runner.req_to_token_pool.req_to_token
    graphs = DecodeGraphRunner(runner.model, runner.kv_pool, table, MAX_BS, capture=False)
    try:
        replayed, sizes = serve(runner, graphs)
    finally:
        runner.graph_runner = None
    assert replayed == plain
    assert {graphs.bucket(n) for n in sizes} == {1, 2, 4, 8, 16}
    for rid, result in plain.items():
        assert len(result["ids"]) == 3 + 2 * int(rid.split("-")[1])
        assert bool(result["logprobs"]) == rid.startswith("logprobs")
