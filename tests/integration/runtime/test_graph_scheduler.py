"""The scheduler driving the embedded model through the decode graph runner (its eager replay on
CPU) gives every request what it gives without it: the same tokens and logprobs, for greedy
requests (whose tokens come from the step's own argmax), greedy ones asking for logprobs, and
seeded sampled ones, while the batch shrinks through the buckets 16, 8, 4, 2 and 1. With the
runner the overlap scheduler is on: plain greedy steps are launched from the previous step's
tokens before the host reads them, and an abort in between loses nothing and leaks nothing."""

from __future__ import annotations

import pytest
import torch

from berth_runtime.io_struct import AbortReq, TokenizedGenerateReqInput
from berth_runtime.managers.scheduler import Scheduler
from berth_runtime.model_executor.cuda_graph_runner import DecodeGraphRunner
from berth_runtime.sampling_params import SamplingParams
from berth_runtime.server_args import ServerArgs
from tests.integration.runtime.engine_steps import load_runner

MAX_BS = 16
SETTINGS = {"max_total_tokens": 4096, "max_running_requests": MAX_BS, "disable_radix_cache": True}


def request(i: int, kind: str, max_new_tokens: int) -> TokenizedGenerateReqInput:
    prompt = [1, *(7 + (13 * i + j) % 900 for j in range(4 + 3 * i))]
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=0.8 if kind == "sampled" else 0.0,
        seed=100 + i if kind == "sampled" else None,
        ignore_eos=True,
    ).normalized()
    return TokenizedGenerateReqInput(
        rid=f"{kind}-{i}",
        input_ids=prompt,
        sampling_params=params,
        stream=True,  # every step's tokens show in the outputs
        return_logprob=kind == "logprobs",
        top_logprobs_num=2 if kind == "logprobs" else 0,
    )


def mixed_requests() -> list[TokenizedGenerateReqInput]:
    """Eleven requests of different lengths: greedy with logprobs and seeded sampling, then the
    three longest plain greedy (alone in the last steps, they take the step's argmax)."""
    kinds = [("logprobs", "sampled")[i % 2] for i in range(8)] + ["greedy"] * 3
    return [request(i, kind, 3 + 2 * i) for i, kind in enumerate(kinds)]


class Served:
    """A scheduler on the runner, with or without the graph runner, and what it put out."""

    def __init__(self, runner, graphs: DecodeGraphRunner | None, **settings) -> None:
        runner.graph_runner = graphs
        runner.kv_pool.clear()
        self.device_inputs: list[bool] = []  # per graph step: were its tokens still on device?
        self.sizes: list[int] = []
        if graphs is not None:
            run = graphs.run

            def record(ids, *rest):
                self.device_inputs.append(isinstance(ids, torch.Tensor))
                self.sizes.append(len(ids))
                return run(ids, *rest)

            graphs.run = record
        self.scheduler = Scheduler(
            ServerArgs(**SETTINGS, **settings), runner, eos_token_ids={2}, decode=str
        )
        self.results: dict[str, dict] = {}

    def step(self) -> None:
        out = self.scheduler.step()
        for o in out.outputs if out else []:
            entry = self.results.setdefault(o.rid, {"ids": [], "logprobs": [], "finish": []})
            entry["ids"] += o.new_token_ids
            entry["logprobs"] += o.output_token_logprobs or []
            if o.finish_reason is not None:
                entry["finish"].append(o.finish_reason.type)

    def run(self, requests: list[TokenizedGenerateReqInput]) -> dict[str, dict]:
        for r in requests:
            self.scheduler.handle_generate(r)
        for _ in range(500):
            if self.scheduler.is_idle:
                return self.results
            self.step()
        raise AssertionError("the scheduler did not finish")

    def assert_all_memory_free(self) -> None:
        kv = self.scheduler.kv
        assert kv.available() == kv.capacity
        assert kv.req_to_token.available_size() == kv.req_to_token.max_reqs


@pytest.fixture(scope="module")
def runner():
    yield (runner := load_runner(**SETTINGS))
    runner.graph_runner = None


def graphs_of(runner) -> DecodeGraphRunner:
    table = runner.req_to_token_pool.req_to_token
    return DecodeGraphRunner(runner.model, runner.kv_pool, table, MAX_BS, capture=False)


def test_graph_runner_steps_equal_the_plain_decode_steps(runner):
    plain = Served(runner, None).run(mixed_requests())
    overlapped = Served(runner, graphs_of(runner))
    assert overlapped.run(mixed_requests()) == plain
    assert {graphs_of(runner).bucket(n) for n in overlapped.sizes} == {1, 2, 4, 8, 16}
    # The three greedy requests' last steps ran from tokens still on the device.
    assert sum(overlapped.device_inputs) >= 4
    overlapped.assert_all_memory_free()
    serial = Served(runner, graphs_of(runner), disable_overlap_schedule=True)
    assert serial.run(mixed_requests()) == plain
    assert not any(serial.device_inputs)
    for rid, result in plain.items():
        assert len(result["ids"]) == 3 + 2 * int(rid.split("-")[1])
        assert bool(result["logprobs"]) == rid.startswith("logprobs")
        assert result["finish"] == ["length"]


def test_abort_while_a_step_is_in_flight(runner):
    """A request aborted between an overlapped step's launch and its read-back ends once, as
    aborted; the others go on to the tokens they get alone, and every KV slot comes back."""
    requests = [request(i, "greedy", 12) for i in range(3)]
    alone = {r.rid: Served(runner, None).run([r])[r.rid]["ids"] for r in requests}
    served = Served(runner, graphs_of(runner))
    for r in requests:
        served.scheduler.handle_generate(r)
    while not (
        served.scheduler.launched and len(served.results.get("greedy-1", {}).get("ids", [])) >= 4
    ):
        served.step()
    served.scheduler.handle_abort(AbortReq(rid="greedy-1"))
    served.run([])
    assert served.results["greedy-1"]["finish"] == ["abort"]
    assert (
        served.results["greedy-1"]["ids"]
        == alone["greedy-1"][: len(served.results["greedy-1"]["ids"])]
    )
    for rid in ("greedy-0", "greedy-2"):
        assert served.results[rid]["ids"] == alone[rid]
        assert served.results[rid]["finish"] == ["length"]
    assert any(served.device_inputs)
    served.assert_all_memory_free()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_overlapped_steps_equal_serial_ones():
    """With captured graphs and real asynchronous copies: the overlap scheduler gives every
    request the tokens the serial one gives."""
    gpu = load_runner(device="cuda", **SETTINGS)
    graphs = gpu.graph_runner
    assert graphs is not None
    serial = Served(gpu, graphs, disable_overlap_schedule=True).run(mixed_requests())
    overlapped = Served(gpu, graphs)
    assert overlapped.run(mixed_requests()) == serial
    assert any(overlapped.device_inputs)
    overlapped.assert_all_memory_free()
