"""Grammar-constrained decoding in the scheduler, with xgrammar over a 32-token toy vocabulary and
the counting fake model: masks, matchers, the compile queue, retraction, preemption and aborts."""

from __future__ import annotations

import re
import time

import pytest
import xgrammar as xgr

from berth_runtime.constrained.grammar import GrammarCompiler, GrammarError, check_grammar
from berth_runtime.constrained.spec import GrammarSpec
from berth_runtime.io_struct import AbortReq
from berth_runtime.managers.scheduler import Scheduler
from berth_runtime.sampling_params import SamplingParams, SamplingParamsError
from berth_runtime.server_args import ServerArgs

from .test_scheduler import (
    EOS,
    VOCAB,
    CountingRunner,
    assert_all_memory_free,
    preq,
    record_retractions,
    req,
)

# Token i is the digit i (0-9), then the letters a-u (10-30); 31 is the end of sequence.
TEXTS = [str(i) for i in range(10)] + [chr(ord("a") + i) for i in range(21)] + ["</s>"]
A, B, C, D, E = 10, 11, 12, 13, 14


def compiler() -> GrammarCompiler:
    info = xgr.TokenizerInfo(
        TEXTS, vocab_type=xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[EOS]
    )
    return GrammarCompiler(lambda: info)


def make(runner: CountingRunner | None = None, grammar: bool = True, **kwargs) -> Scheduler:
    return Scheduler(
        ServerArgs(**kwargs),
        runner or CountingRunner(),
        eos_token_ids={EOS},
        decode=lambda ids: "".join(TEXTS[i] for i in ids),
        grammar=compiler() if grammar else None,
    )


def run_to_idle(s: Scheduler, timeout: float = 30.0) -> dict[str, list]:
    """Step until idle (waiting, as the scheduler's loop does, while grammars compile on their
    thread); each rid's tokens and finish reason."""
    outputs: dict[str, list] = {}
    deadline = time.monotonic() + timeout
    while not s.is_idle:
        assert time.monotonic() < deadline, "the scheduler did not become idle"
        if s.only_compiling:
            time.sleep(0.001)
        out = s.step()
        for o in out.outputs if out else []:
            entry = outputs.setdefault(o.rid, [[], None])
            entry[0] += o.new_token_ids
            entry[1] = o.finish_reason or entry[1]
    return outputs


def text(ids: list[int]) -> str:
    return "".join(TEXTS[i] for i in ids if i != EOS)


def test_the_grammar_overrides_the_model_and_ends_the_request():
    # The fake model counts: after 9 it says a, b, c, d, e, ... The grammar allows "ab(c|d)e"
    # only, so after "abc" it forces "e", and then the end of sequence.
    s = make()
    s.handle_generate(req("r", [9], max_new_tokens=20, regex="ab(c|d)e"))
    s.handle_generate(req("free", [9], max_new_tokens=6))
    out = run_to_idle(s)
    assert out["r"][0] == [A, B, C, E, EOS]
    assert out["r"][1].type == "stop" and out["r"][1].matched_token == EOS
    assert out["free"][0] == [A, B, C, D, E, 15]  # the same batch, unconstrained
    assert_all_memory_free(s)


def test_a_finished_grammar_ends_the_request_even_with_ignore_eos_or_min_tokens():
    s = make()
    s.handle_generate(req("r", [9], max_new_tokens=20, regex="abc", ignore_eos=True))
    s.handle_generate(req("min", [9], max_new_tokens=20, regex="abc", min_new_tokens=10))
    out = run_to_idle(s)
    for rid in ("r", "min"):
        assert text(out[rid][0]) == "abc" and out[rid][1].type == "stop", out[rid]


def test_constrained_logprobs_are_over_what_the_grammar_allows():
    s = make()
    msg = req("r", [9], max_new_tokens=20, regex="ab(c|d)e")
    msg.return_logprob = True
    s.handle_generate(msg)
    logprobs: list[float] = []
    while not s.is_idle:
        if s.only_compiling:
            time.sleep(0.001)
        out = s.step()
        for o in out.outputs if out else []:
            logprobs += o.output_token_logprobs or []
    # Each of a, b, e and the end was the only token allowed: probability 1.
    assert [logprobs[i] for i in (0, 1, 3, 4)] == [0.0] * 4
    assert logprobs[2] < 0.0  # c or d: the model's own preference between two


def test_ebnf_and_json_schema_grammars():
    s = make()
    s.handle_generate(req("ebnf", [1], max_new_tokens=20, ebnf='root ::= "dab" | "cab"'))
    s.handle_generate(
        req(
            "json",
            [1],
            max_new_tokens=20,
            json_schema='{"type": "integer", "minimum": 10, "maximum": 99}',
        )
    )
    out = run_to_idle(s)
    assert text(out["ebnf"][0]) in ("dab", "cab")
    number = text(out["json"][0])
    assert number.isdigit() and 10 <= int(number) <= 99, number


def test_retraction_keeps_each_constrained_request_on_its_grammar():
    pattern = "[a-u]{6}[0-9]{6}[a-u]{6}"

    def run(kv_tokens: int) -> tuple[dict[str, list], Scheduler, list[str]]:
        s = make(CountingRunner(kv_tokens=kv_tokens))
        for rid, start in (("a", 1), ("b", 3), ("c", 5)):
            s.handle_generate(req(rid, [start] * 8, max_new_tokens=30, regex=pattern))
        retracted = record_retractions(s)
        return run_to_idle(s), s, retracted

    roomy, _, none_retracted = run(400)
    tight, s, retracted = run(40)
    assert not none_retracted and retracted, "the small pool must force a retraction"
    assert tight == roomy  # resumed where it was, in the output and in the grammar
    for ids, finish in tight.values():
        assert re.fullmatch(pattern, text(ids)), text(ids)
        assert finish.type == "stop"
    assert_all_memory_free(s)


def test_priority_preemption_keeps_a_constrained_request_on_its_grammar():
    pattern = "[a-u]{4}[0-9]{8}"
    s = make(schedule_policy="priority", max_running_requests=2)
    # "old" outlasts however long "new"'s grammar takes to compile.
    s.handle_generate(preq("old", [1], 0, max_new_tokens=200, ignore_eos=True))
    s.handle_generate(preq("new", [3], 0, max_new_tokens=20, regex=pattern))
    outputs: dict[str, list] = {}

    def step() -> None:
        out = s.step()
        for o in out.outputs if out else []:
            entry = outputs.setdefault(o.rid, [[], None])
            entry[0] += o.new_token_ids
            entry[1] = o.finish_reason or entry[1]

    while not any(r.rid == "new" and len(r.output_ids) >= 3 for r in s.policy.running):
        if s.only_compiling:
            time.sleep(0.001)
        step()
    s.handle_generate(preq("high", [20], 5, max_new_tokens=4))
    step()
    assert any(r.rid == "new" for r in s.policy.waiting), "new must have been preempted"
    while not s.is_idle:
        step()
    alone = make()
    alone.handle_generate(req("new", [3], max_new_tokens=20, regex=pattern))
    assert outputs["new"] == run_to_idle(alone)["new"]
    assert_all_memory_free(s)


def test_abort_while_the_grammar_compiles_and_while_decoding():
    s = make()
    s.handle_generate(req("compiling", [1], max_new_tokens=20, regex="[a-u]{10}"))
    s.handle_abort(AbortReq(rid="compiling", message="gone", status_code=499))
    assert not s.grammar_queue
    out = run_to_idle(s)
    assert out["compiling"][1].type == "abort" and out["compiling"][1].status_code == 499
    s.handle_generate(req("decoding", [1], max_new_tokens=20, regex="[a-u]{10}"))
    while not any(r.rid == "decoding" and r.output_ids for r in s.policy.running):
        if s.only_compiling:
            time.sleep(0.001)
        s.step()
    s.handle_abort(AbortReq(rid="decoding", message="gone", status_code=499))
    assert run_to_idle(s)["decoding"][1].type == "abort"
    assert_all_memory_free(s)


def test_an_invalid_grammar_or_none_to_compile_it_is_refused_with_400():
    s = make()
    s.handle_generate(req("bad", [1], max_new_tokens=5, regex="a(b"))
    off = make(grammar=False)
    off.handle_generate(req("off", [1], max_new_tokens=5, regex="ab"))
    bad, refused = run_to_idle(s)["bad"][1], run_to_idle(off)["off"][1]
    assert bad.type == "abort" and bad.status_code == 400 and "parenthesis" in bad.message
    assert refused.status_code == 400 and "--grammar-backend none" in refused.message


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec("json_schema", '{"type": "objectt"}'), 'Unsupported type "objectt"'),
        (GrammarSpec("json_schema", "{not json"), "Failed to parse JSON"),
        (GrammarSpec("regex", "a(b"), "The parenthesis is not closed"),
        (GrammarSpec("ebnf", "root ::= foo"), 'Rule "foo" is not defined'),
    ],
)
def test_check_grammar_gives_the_engines_message_without_its_log_prefix(spec, message):
    with pytest.raises(GrammarError) as caught:
        check_grammar(spec)
    assert message in str(caught.value) and not str(caught.value).startswith("[")


def test_at_most_one_grammar_per_request():
    params = SamplingParams(regex="a", ebnf='root ::= "a"')
    with pytest.raises(SamplingParamsError) as caught:
        params.verify(VOCAB)
    assert caught.value.param == "ebnf"
    assert SamplingParams(regex="a+").grammar == GrammarSpec("regex", "a+")
