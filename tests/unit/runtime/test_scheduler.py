"""Scheduler bookkeeping with a fake model runner (no weights): batching, finishing, chunking,
retraction, aborts and KV accounting."""

from __future__ import annotations

import torch

from berth_runtime.io_struct import AbortReq, TokenizedGenerateReqInput
from berth_runtime.managers.scheduler import Scheduler
from berth_runtime.mem_cache.kv_pool import ReqToTokenPool, TokenToKVPool
from berth_runtime.model_executor.forward_batch import DecodeLogits, ForwardBatch
from berth_runtime.sampling_params import SamplingParams
from berth_runtime.server_args import ServerArgs

VOCAB = 32
EOS = 31


class CountingRunner:
    """A 'model' whose next token is always the last token + 1 (mod VOCAB); records every batch."""

    def __init__(self, kv_tokens: int = 1024, max_reqs: int = 8, context_len: int = 256) -> None:
        self.device = torch.device("cpu")
        self.vocab_size = VOCAB
        self.context_len = context_len
        self.kv_pool = TokenToKVPool(kv_tokens, 1, 1, 1, torch.float32, self.device)
        self.req_to_token_pool = ReqToTokenPool(max_reqs, context_len + 1, self.device)
        self.batches: list[tuple[bool, int, int]] = []  # (is_decode, batch size, new tokens)
        self.exact_decode = True  # decode K/V equal a prefill's (see decode_matches_prefill)
        self.needs_attn_mask = True

    def forward(self, batch):
        # Every token's slot must be a real, allocated slot (never the padding slot 0).
        assert int(batch.out_cache_loc.min()) > 0
        self.batches.append((batch.is_decode, batch.batch_size, int(batch.input_ids.numel())))
        return batch.input_ids.float()[:, None]

    def forward_decode(self, input_ids, cached_lens, out_cache_loc, req_rows):
        table = self.req_to_token_pool.req_to_token
        batch = ForwardBatch.decode(
            input_ids, cached_lens, out_cache_loc, req_rows, table, self.device
        )
        return DecodeLogits(self.compute_logits(self.forward(batch)))

    def decode_matches_prefill(self, batch_size):
        return self.exact_decode

    def compute_logits(self, hidden):
        nxt = (hidden[:, 0].long() + 1) % VOCAB
        return torch.nn.functional.one_hot(nxt, VOCAB).float() * 10


def make_scheduler(runner=None, **kwargs) -> Scheduler:
    runner = runner or CountingRunner()
    args = ServerArgs(**kwargs)
    return Scheduler(
        args, runner, eos_token_ids={EOS}, decode=lambda ids: "".join(f"<{i}>" for i in ids)
    )


def req(rid: str, prompt: list[int], stream: bool = True, **params) -> TokenizedGenerateReqInput:
    """A greedy request; streaming, so that every step's progress shows in the outputs."""
    params.setdefault("temperature", 0.0)
    return TokenizedGenerateReqInput(
        rid=rid,
        input_ids=prompt,
        sampling_params=SamplingParams(**params).normalized(),
        stream=stream,
    )


def rids(out) -> list[str]:
    return [o.rid for o in out.outputs]


def run_to_idle(s: Scheduler, max_steps: int = 1000) -> dict[str, list]:
    """Step until idle; collect each rid's tokens and finish reason."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if s.is_idle:
            return outputs
        out = s.step()
        if out is None:
            continue
        for o in out.outputs:
            rid, ids, fin = o.rid, o.new_token_ids, o.finish_reason
            entry = outputs.setdefault(rid, [[], None])
            entry[0] += ids
            if fin is not None:
                entry[1] = fin
    raise AssertionError("scheduler did not become idle")


def assert_all_memory_free(s: Scheduler) -> None:
    """No request holds KV: every slot is free or an unlocked (evictable) cache entry."""
    kv = s.kv
    assert kv.available() + kv.evictable_size() == kv.capacity
    assert kv.tree is None or kv.tree.protected_size == 0
    assert kv.req_to_token.available_size() == kv.req_to_token.max_reqs


def test_single_request_counts_and_stops_at_length():
    s = make_scheduler()
    s.handle_generate(req("a", [1, 2, 3], max_new_tokens=5))
    out = run_to_idle(s)
    assert out["a"][0] == [4, 5, 6, 7, 8]
    assert out["a"][1].type == "length"
    assert_all_memory_free(s)


def test_eos_and_stop_tokens_finish_unless_ignored():
    s = make_scheduler()
    s.handle_generate(req("eos", [28], max_new_tokens=10))
    s.handle_generate(req("ignore", [28], max_new_tokens=5, ignore_eos=True))
    s.handle_generate(req("stop-id", [3], max_new_tokens=10, stop_token_ids=[6]))
    s.handle_generate(req("min", [29], max_new_tokens=10, min_new_tokens=3))
    out = run_to_idle(s)
    assert out["eos"][0] == [29, 30, 31] and out["eos"][1].matched_token == EOS
    assert out["ignore"][0] == [29, 30, 31, 0, 1] and out["ignore"][1].type == "length"
    assert out["stop-id"][0] == [4, 5, 6] and out["stop-id"][1].matched_token == 6
    # EOS is masked until min_new_tokens: the fake then takes its second choice (token 0).
    assert len(out["min"][0]) >= 3 and out["min"][0][:2] == [30, 0]
    assert_all_memory_free(s)


def test_stop_string_finishes():
    s = make_scheduler()
    s.handle_generate(req("a", [1], max_new_tokens=10, stop=["<4><5>"]))
    out = run_to_idle(s)
    assert out["a"][0] == [2, 3, 4, 5]
    assert out["a"][1].matched_str == "<4><5>"


def test_requests_join_and_leave_between_decode_steps():
    runner = CountingRunner()
    s = make_scheduler(runner)
    s.handle_generate(req("long", [1], max_new_tokens=8))
    s.step()  # prefill of "long"
    s.step()  # decode
    s.handle_generate(req("short", [10], max_new_tokens=2))
    s.step()  # prefill of "short" joins
    assert [r.rid for r in s.policy.running] == ["long", "short"]
    s.step()  # one decode step for both
    assert runner.batches[-1] == (True, 2, 2)
    assert [r.rid for r in s.policy.running] == ["long"]  # "short" left after its 2 tokens
    out = run_to_idle(s)
    assert out["long"][0][-1] == 9  # prompt [1] + 8 tokens counting up
    assert_all_memory_free(s)


def test_chunked_prefill_alternates_with_decode_and_matches_unchunked():
    prompt = list(range(1, 30)) * 2  # 58 tokens
    unchunked = make_scheduler(chunked_prefill_size=0)
    unchunked.handle_generate(req("p", prompt, max_new_tokens=4))
    expected = run_to_idle(unchunked)["p"][0]

    runner = CountingRunner()
    s = make_scheduler(runner, chunked_prefill_size=16)
    s.handle_generate(req("stream", [5], max_new_tokens=20))
    s.step()
    s.handle_generate(req("p", prompt, max_new_tokens=4))
    out = run_to_idle(s)
    assert out["p"][0] == expected
    prefills = [b for b in runner.batches if not b[0]]
    # "stream"'s one-token prompt is an extend too, never a decode step (other weights).
    assert [b[2] for b in prefills] == [1, 16, 16, 16, 10]
    # Between two prefill chunks there is always a decode step for the running stream.
    kinds = [b[0] for b in runner.batches[1:12]]
    assert all(a or b for a, b in zip(kinds, kinds[1:])), kinds
    assert_all_memory_free(s)


def test_retraction_when_kv_runs_out_keeps_every_token():
    alone = {}
    for rid, start in (("a", 1), ("b", 3), ("c", 5)):
        s1 = make_scheduler(CountingRunner(kv_tokens=200))
        s1.handle_generate(req(rid, [start] * 8, max_new_tokens=20))
        alone[rid] = run_to_idle(s1)[rid][0]

    s = make_scheduler(CountingRunner(kv_tokens=40))
    for rid, start in (("a", 1), ("b", 3), ("c", 5)):
        s.handle_generate(req(rid, [start] * 8, max_new_tokens=20))
    retracted = record_retractions(s)
    out = run_to_idle(s)
    assert retracted, "the pool was too small: something must have been retracted"
    assert {rid: v[0] for rid, v in out.items()} == alone
    assert all(v[1].type == "length" for v in out.values())
    assert_all_memory_free(s)


def record_retractions(s: Scheduler) -> list[str]:
    """The rids whose KV the scheduler gives back before they finish (retracted), in order."""
    retracted: list[str] = []
    original = s.kv.release

    def spy(r):
        if not r.finished and r.kv_len:
            retracted.append(r.rid)
        original(r)

    s.kv.release = spy
    return retracted


def test_abort_waiting_and_running_frees_memory():
    s = make_scheduler()
    s.handle_generate(req("run", [1], max_new_tokens=50))
    s.step()
    s.handle_generate(req("wait", [1], max_new_tokens=50))
    s.handle_abort(AbortReq(rid="run", message="gone", status_code=499))
    s.handle_abort(AbortReq(rid="wait"))
    out = run_to_idle(s)
    assert out["run"][1].type == "abort" and out["run"][1].status_code == 499
    assert out["wait"][1].type == "abort"
    assert_all_memory_free(s)


def test_queue_limit_counts_only_requests_that_cannot_run_and_rejects_with_503():
    s = make_scheduler(max_queued_requests=1, max_running_requests=2)
    for rid in "abcd":  # a and b take the free batch slots, c queues, d is one too many
        s.handle_generate(req(rid, [1], max_new_tokens=2))
    out = run_to_idle(s)
    assert [out[r][1].type for r in "abc"] == ["length"] * 3
    assert out["d"][1].type == "abort" and out["d"][1].status_code == 503


def test_max_running_requests_caps_the_batch():
    runner = CountingRunner()
    s = make_scheduler(runner, max_running_requests=2)
    for i in range(5):
        s.handle_generate(req(f"r{i}", [i + 1], max_new_tokens=3))
    run_to_idle(s)
    assert max(b[1] for b in runner.batches if b[0]) == 2
    assert_all_memory_free(s)


def test_priority_policy_admits_higher_priority_first():
    s = make_scheduler(schedule_policy="priority", max_running_requests=1)
    low = req("low", [1], max_new_tokens=1)
    high = TokenizedGenerateReqInput(
        rid="high", input_ids=[1], sampling_params=SamplingParams(max_new_tokens=1), priority=5
    )
    s.handle_generate(low)
    s.handle_generate(high)
    first = s.step()
    assert first is not None and rids(first) == ["high"]


def test_stats_account_tokens():
    s = make_scheduler()
    s.handle_generate(req("a", [1, 2, 3, 4], max_new_tokens=30))
    s.step()
    stats = s.get_stats()
    assert stats.num_running_reqs == 1
    assert stats.num_used_tokens == 4  # the prompt's slots; the first output token has none yet
    s.step()
    assert s.get_stats().num_used_tokens == 5
    run_to_idle(s)
    assert s.get_stats().num_used_tokens == 0


def test_repeated_prompt_reuses_the_cached_prefix_with_identical_output():
    runner = CountingRunner()
    s = make_scheduler(runner)
    prompt = list(range(1, 25))
    s.handle_generate(req("first", prompt, max_new_tokens=4))
    first = run_to_idle(s)["first"][0]
    s.handle_generate(req("second", prompt, max_new_tokens=4))
    out = s.step()
    assert out is not None and [o.cached_tokens for o in out.outputs] == [len(prompt) - 1]
    assert runner.batches[-1][2] == 1  # only the last prompt token was computed
    second = out.outputs[0].new_token_ids + run_to_idle(s)["second"][0]
    assert second == first
    assert s.get_stats().cache_hit_rate > 0.4
    assert_all_memory_free(s)


def test_disabled_radix_cache_computes_everything():
    runner = CountingRunner()
    s = make_scheduler(runner, disable_radix_cache=True)
    for rid in ("a", "b"):
        s.handle_generate(req(rid, list(range(1, 25)), max_new_tokens=2))
        run_to_idle(s)
    assert s.kv.tree is None
    assert [b[2] for b in runner.batches if not b[0]] == [24, 24]
    assert_all_memory_free(s)


def test_cache_is_evicted_when_new_work_needs_the_memory():
    s = make_scheduler(CountingRunner(kv_tokens=64))
    for i in range(6):  # 6 distinct 20-token prompts: far more than the pool keeps
        s.handle_generate(req(f"r{i}", [i + 1] * 20, max_new_tokens=3))
        out = run_to_idle(s)
        assert out[f"r{i}"][1].type == "length"
    assert s.kv.tree is not None and s.kv.tree.total_size <= 64
    assert_all_memory_free(s)


def test_flush_cache_only_when_idle_and_then_empty():
    s = make_scheduler()
    s.handle_generate(req("a", list(range(1, 10)), max_new_tokens=30))
    s.step()
    assert not s.handle_flush_cache(None).success
    run_to_idle(s)
    assert s.kv.tree is not None and s.kv.tree.total_size > 0
    assert s.handle_flush_cache(None).success
    assert s.kv.tree.total_size == 0 and s.kv.available() == s.kv.capacity


def test_lpm_policy_prefers_the_longest_cached_prefix():
    s = make_scheduler(schedule_policy="lpm", max_running_requests=1)
    s.handle_generate(req("warm", [9] * 20, max_new_tokens=1))
    run_to_idle(s)
    s.handle_generate(req("cold", [3] * 20, max_new_tokens=1))
    s.handle_generate(req("hot", [9] * 20, max_new_tokens=1))
    first = s.step()
    assert first is not None and rids(first) == ["hot"]


def test_a_running_request_shares_its_prompt_with_requests_arriving_later():
    runner = CountingRunner()
    s = make_scheduler(runner)
    prompt = list(range(1, 25))
    s.handle_generate(req("first", prompt, max_new_tokens=30))
    s.step()  # "first" is prefilled and keeps decoding
    s.handle_generate(req("second", prompt + [9, 9], max_new_tokens=2))
    out = run_to_idle(s)
    assert out["second"][1].type == "length"
    second_prefill = [b for b in runner.batches if not b[0]][-1]
    assert second_prefill[2] == 2  # only the two new tokens were computed
    assert_all_memory_free(s)


def preq(rid: str, prompt: list[int], priority: int, **params) -> TokenizedGenerateReqInput:
    msg = req(rid, prompt, **params)
    msg.priority = priority
    return msg


def run_alone(rid: str, prompt: list[int], n: int) -> list[int]:
    s = make_scheduler()
    s.handle_generate(req(rid, prompt, max_new_tokens=n))
    return run_to_idle(s)[rid][0]


def fill_batch_then_arrive(policy: str, high_priority: int, **kwargs):
    """Two low-priority requests fill the batch and decode a few steps; then `high` arrives."""
    s = make_scheduler(schedule_policy=policy, max_running_requests=2, **kwargs)
    outputs: dict[str, list] = {}

    def step():
        out = s.step()
        if out is not None:
            for rid, ids, fin in ((o.rid, o.new_token_ids, o.finish_reason) for o in out.outputs):
                entry = outputs.setdefault(rid, [[], None])
                entry[0] += ids
                if fin is not None:
                    entry[1] = fin
        return out

    s.handle_generate(preq("old", [1], 0, max_new_tokens=12))
    s.handle_generate(preq("new", [3], 0, max_new_tokens=12))
    for _ in range(4):
        step()
    assert [r.rid for r in s.policy.running] == ["old", "new"]
    s.handle_generate(preq("high", [20], high_priority, max_new_tokens=4))
    return s, outputs, step


def test_priority_preempts_the_lowest_newest_running_request_and_loses_nothing():
    s, outputs, step = fill_batch_then_arrive("priority", 5)
    kept = len(outputs["new"][0])
    out = step()
    assert out is not None and rids(out) == ["high"]  # scheduled at once
    assert [r.rid for r in s.policy.running] == ["old", "high"]
    victim = next(r for r in s.policy.waiting if r.rid == "new")
    assert len(victim.output_ids) == kept > 0 and victim.req_row is None
    while not s.is_idle:
        step()
    assert all(v[1].type == "length" for v in outputs.values())
    assert outputs["old"][0] == run_alone("old", [1], 12)
    assert outputs["new"][0] == run_alone("new", [3], 12)  # no token lost or repeated
    assert outputs["high"][0] == run_alone("high", [20], 4)
    assert_all_memory_free(s)


def test_priority_preempts_when_kv_memory_is_short():
    runner = CountingRunner(kv_tokens=48)
    s = make_scheduler(runner, schedule_policy="priority")
    s.handle_generate(preq("low", [1] * 20, 0, max_new_tokens=20))
    first = [s.step(), s.step()]
    s.handle_generate(preq("high", [2] * 20, 1, max_new_tokens=8))
    out = s.step()
    assert out is not None and rids(out) == ["high"]  # 48 slots do not hold both: "low" yields
    assert [r.rid for r in s.policy.waiting] == ["low"]
    outputs = run_to_idle(s)
    low = [t for o in first if o is not None for t in o.outputs[0].new_token_ids] + outputs["low"][
        0
    ]
    assert outputs["low"][1].type == "length"
    assert low == run_alone("low", [1] * 20, 20)
    assert_all_memory_free(s)


def test_equal_priority_never_preempts():
    s, outputs, step = fill_batch_then_arrive("priority", 0)
    out = step()
    assert out is not None and "high" not in rids(out)
    assert [r.rid for r in s.policy.running] == ["old", "new"]
    assert [r.rid for r in s.policy.waiting] == ["high"]


def test_fcfs_and_lpm_never_preempt():
    for policy in ("fcfs", "lpm"):
        s, outputs, step = fill_batch_then_arrive(policy, 5)
        out = step()
        assert out is not None and "high" not in rids(out), policy
        assert [r.rid for r in s.policy.running] == ["old", "new"], policy


def test_decoded_kv_is_cached_only_when_decode_matches_prefill():
    """The radix cache keeps only K/V that a prefill of the same tokens computes: a later turn
    that reuses them answers as it would without the cache."""
    prompt = list(range(1, 11))  # 10 tokens; 4 generated: 11 12 13 14 (14 never fed back)
    for exact, cached_after in ((True, 13), (False, 10)):
        runner = CountingRunner()
        runner.exact_decode = exact
        s = make_scheduler(runner)
        s.handle_generate(req("turn1", prompt, max_new_tokens=4))
        assert run_to_idle(s)["turn1"][0] == [11, 12, 13, 14]
        assert s.kv.tree is not None and s.kv.tree.total_size == cached_after
        assert_all_memory_free(s)
        # The next turn reuses exactly what was cached (less its last token, which it reruns).
        s.handle_generate(req("turn2", [*prompt, 11, 12, 13, 14, 20, 21], max_new_tokens=1))
        run_to_idle(s)
        prefills = [b[2] for b in runner.batches if not b[0]]
        assert prefills == [10, 16 - cached_after], prefills
        assert_all_memory_free(s)


def test_decode_after_a_decode_that_did_not_match_stays_uncached():
    """exact_len stops at the first decode step that ran on other weights, even if later steps
    match again (a batch grew past the 4-bit limit): the cache holds a prefix, never a gap."""
    runner = CountingRunner()
    s = make_scheduler(runner)
    s.handle_generate(req("a", [1, 2, 3], max_new_tokens=6))
    s.step()  # prefill: exact_len 3
    runner.exact_decode = False
    s.step()  # decode on other weights: token 4's K/V are not exact
    runner.exact_decode = True
    run_to_idle(s)
    assert s.kv.tree is not None and s.kv.tree.total_size == 3
    assert_all_memory_free(s)


def test_a_request_that_does_not_stream_is_sent_once_when_it_finishes():
    """Nothing reads a non-streaming request's partial output: it is neither detokenized nor
    sent until it finishes, and then it carries every token."""
    s = make_scheduler()
    s.handle_generate(req("quiet", [1, 2, 3], stream=False, max_new_tokens=4))
    s.handle_generate(req("loud", [7, 8, 9], max_new_tokens=4))
    sent = []
    while not s.is_idle:
        out = s.step()
        if out is not None:
            sent.append(out.outputs)
    quiet = [o for step in sent for o in step if o.rid == "quiet"]
    loud = [o for step in sent for o in step if o.rid == "loud"]
    assert len(quiet) == 1 and quiet[0].new_token_ids == [4, 5, 6, 7]
    assert quiet[0].finish_reason is not None and quiet[0].completion_tokens == 4
    assert len(loud) == 4 and [t for o in loud for t in o.new_token_ids] == [10, 11, 12, 13]
