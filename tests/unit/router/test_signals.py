"""What the router reads from a request: pinning (validated), routing keys, and routing text whose
prefixes follow the prompt's; plus `berth router` flag parsing and validation."""

from __future__ import annotations

import json

import pytest

from berth_common.response_ids import new_response_id, rank_of_response
from berth_router.args import RouterArgs
from berth_router.server import build_parser
from berth_router.signals import (
    DP_RANK_HEADER,
    ROUTING_KEY_HEADER,
    RouteSignals,
    SignalError,
    read_signals,
    routing_text,
)

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"


def signals(body: object, headers: dict[str, str] | None = None, path: str = CHAT) -> RouteSignals:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return read_signals(path, raw, headers or {})


# --- pinning -----------------------------------------------------------------------------------


def test_pin_by_body_field_or_header_and_the_body_wins() -> None:
    assert signals({"routed_dp_rank": 2}).pinned_rank == 2
    assert signals({"routed_dp_rank": 2}).pinned_by == "routed_dp_rank"
    by_header = signals({}, {DP_RANK_HEADER: "1"})
    assert (by_header.pinned_rank, by_header.pinned_by) == (1, DP_RANK_HEADER)
    assert signals({}, {DP_RANK_HEADER.lower(): " 0 "}).pinned_rank == 0
    assert signals({"routed_dp_rank": 2}, {DP_RANK_HEADER: "1"}).pinned_rank == 2
    assert signals({"routed_dp_rank": None}, {DP_RANK_HEADER: "1"}).pinned_rank == 1
    assert signals({}).pinned_rank is None


@pytest.mark.parametrize("value", [-1, "1", 1.5, True, [0]])
def test_bad_body_pin_is_a_400_naming_the_field(value: object) -> None:
    with pytest.raises(SignalError) as e:
        signals({"routed_dp_rank": value})
    assert e.value.param == "routed_dp_rank"
    assert "non-negative integer" in e.value.message


@pytest.mark.parametrize("value", ["-1", "one", "", "1.0"])
def test_bad_header_pin_is_a_400_naming_the_header(value: str) -> None:
    with pytest.raises(SignalError) as e:
        signals({}, {DP_RANK_HEADER: value})
    assert e.value.param == DP_RANK_HEADER


def test_routing_key_from_field_or_header() -> None:
    assert signals({"routing_key": "user-7"}).routing_key == "user-7"
    assert signals({}, {ROUTING_KEY_HEADER: "tenant-a"}).routing_key == "tenant-a"
    assert signals({"routing_key": "f"}, {ROUTING_KEY_HEADER: "h"}).routing_key == "f"
    assert signals({"routing_key": ""}).routing_key is None
    with pytest.raises(SignalError) as e:
        signals({"routing_key": 5})
    assert e.value.param == "routing_key"


def test_a_body_that_is_not_json_is_routed_anyway_for_the_rank_to_reject() -> None:
    s = signals(b"{not json", {DP_RANK_HEADER: "1"})
    assert (s.pinned_rank, s.text) == (1, "")
    assert signals(b"[1, 2]").text == ""
    assert signals(b"").pinned_rank is None


# --- routing text ------------------------------------------------------------------------------


def test_chat_text_shares_a_prefix_exactly_when_the_conversation_does() -> None:
    system = {"role": "system", "content": "You are terse."}
    a = routing_text(CHAT, {"messages": [system, {"role": "user", "content": "Hi"}]})
    b = routing_text(CHAT, {"messages": [system, {"role": "user", "content": "Bye"}]})
    c = routing_text(CHAT, {"messages": [{"role": "user", "content": "You are terse."}]})
    common = len(routing_text(CHAT, {"messages": [system]}))
    assert a[:common] == b[:common] and a != b
    assert not c.startswith(a[:common])  # same words, different role: not the same prompt
    parts = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    }
    assert routing_text(CHAT, parts) == routing_text(
        CHAT, {"messages": [{"role": "user", "content": "Hi"}]}
    )


def test_a_continued_response_is_pinned_to_the_rank_in_its_id() -> None:
    previous = {"input": "more", "previous_response_id": new_response_id(2)}
    pinned = signals(previous, path=RESPONSES)
    assert (pinned.pinned_rank, pinned.pinned_by) == (2, "previous_response_id")
    # An explicit pin wins; an id without a rank (a one-rank server's) pins nothing.
    assert signals({**previous, "routed_dp_rank": 0}, path=RESPONSES).pinned_rank == 0
    assert (
        signals({"previous_response_id": new_response_id(None)}, path=RESPONSES).pinned_rank is None
    )
    assert signals(previous, path=CHAT).pinned_rank is None
    assert rank_of_response("resp_r12_abc") == 12
    assert rank_of_response("resp_rx_abc") is None and rank_of_response("chatcmpl-1") is None


def test_responses_text_is_chat_text_with_instructions_as_the_system_message() -> None:
    chat = routing_text(
        CHAT,
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ]
        },
    )
    assert routing_text(RESPONSES, {"instructions": "Be brief.", "input": "Hi"}) == chat
    items = {"instructions": "Be brief.", "input": [{"role": "user", "content": "Hi"}]}
    assert routing_text(RESPONSES, items) == chat


def test_completion_and_generate_text() -> None:
    assert routing_text("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    ids = routing_text("/v1/completions", {"prompt": [1, 2, 3]})
    longer = routing_text("/v1/completions", {"prompt": [1, 2, 3, 4]})
    assert len(ids) == 3 and longer.startswith(ids)
    assert routing_text("/v1/completions", {"prompt": [[5, 6], [7]]}) == routing_text(
        "/v1/completions", {"prompt": [5, 6]}
    )
    assert routing_text("/generate", {"text": "The capital"}) == "The capital"
    assert routing_text("/generate", {"input_ids": [9, 8]}) == routing_text(
        "/v1/completions", {"prompt": [9, 8]}
    )
    assert routing_text("/v1/models", {}) == ""
    assert routing_text("/v1/completions", {"prompt": None}) == ""


# --- flags -------------------------------------------------------------------------------------


def parse(*argv: str) -> RouterArgs:
    return RouterArgs.from_cli_args(build_parser().parse_args(list(argv)))


def test_flags_parse_into_router_args() -> None:
    args = parse(
        "--worker-urls",
        "http://a:1/",
        "http://b:2",
        "--policy",
        "round_robin",
        "--cache-threshold",
        "0.6",
        "--max-retries",
        "0",
        "--request-timeout",
        "30",
    )
    assert args.worker_urls == ("http://a:1", "http://b:2")
    assert args.policy == "round_robin"
    assert args.cache_threshold == 0.6
    assert args.max_retries == 0
    assert args.request_timeout == 30.0
    assert not args.discovery
    defaults = parse("--worker-urls", "http://a:1")
    assert defaults.policy == "cache_aware" and defaults.request_timeout is None
    discovered = parse("--discover-selector", "a=b,c", "--discover-namespace", "ns")
    assert discovered.discovery and discovered.worker_urls == ()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--worker-urls", "a:1"], "not an http"),
        (["--worker-urls", "http://a", "--discover-selector", "x"], "not both"),
        (["--cache-threshold", "1.5"], "cache-threshold"),
        (["--health-check-interval", "0"], "health-check-interval"),
        (["--max-retries", "-1"], "max-retries"),
        (["--balance-rel-threshold", "0.5"], "balance"),
        (["--port", "0"], "port"),
    ],
)
def test_bad_flags_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_api_key_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BERTH_API_KEY", "s3cret")
    assert parse("--worker-urls", "http://a").api_key == "s3cret"
    assert parse("--worker-urls", "http://a", "--api-key", "mine").api_key == "mine"


def test_berth_router_needs_workers_or_discovery(capsys: pytest.CaptureFixture[str]) -> None:
    from berth_common.cli import main

    with pytest.raises(SystemExit) as e:
        main(["router"])
    assert e.value.code == 2
    assert "--worker-urls" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["router", "--discover-selector", "a=b"])  # outside a pod: no namespace, no API
    assert "--discover-namespace" in capsys.readouterr().err
