"""What a request tells the router: a pinned rank, a routing key, and the text to match prefixes on.

The router reads the body without changing it: the bytes go to the rank as they came. A body that
is not JSON is routed anyway (by policy, on an empty text) so that the rank answers with its own
400, exactly as without a router.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from berth_common.response_ids import rank_of_response

DP_RANK_HEADER = "X-Data-Parallel-Rank"
ROUTING_KEY_HEADER = "X-Routing-Key"


class SignalError(ValueError):
    """A routing signal the router cannot honour (a 400 for the client)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class RouteSignals:
    pinned_rank: int | None = None
    pinned_by: str | None = None  # "routed_dp_rank" or the header: the param of a pin error
    routing_key: str | None = None
    text: str = ""
    # The request's `model` (or /generate's `lora_path`): a LoRA adapter's name goes to a rank
    # that serves it.
    model: str | None = None


# Ends each chat message in the routing text (ASCII's record separator: never in real text).
MESSAGE_END = "\x1e"


def read_signals(path: str, body: bytes, headers: Mapping[str, str]) -> RouteSignals:
    """Signals of one generation request; as in the runtime, a body field wins over its header."""
    try:
        payload: Any = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        payload = None
    if not isinstance(payload, dict):
        payload = {}
    rank, pinned_by = _pinned_rank(payload, headers)
    if rank is None and path.endswith("/responses"):
        rank, pinned_by = _stored_response_rank(payload)
    return RouteSignals(
        pinned_rank=rank,
        pinned_by=pinned_by,
        routing_key=_routing_key(payload, headers),
        text=routing_text(path, payload),
        model=_model(payload),
    )


def _model(payload: Mapping[str, Any]) -> str | None:
    model = payload.get("lora_path") or payload.get("model")
    return model if isinstance(model, str) and model else None


def _pinned_rank(
    payload: dict[str, Any], headers: Mapping[str, str]
) -> tuple[int | None, str | None]:
    value = payload.get("routed_dp_rank")
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SignalError(
                f"routed_dp_rank must be a non-negative integer, got {value!r}", "routed_dp_rank"
            )
        return value, "routed_dp_rank"
    header = _header(headers, DP_RANK_HEADER)
    if header is None:
        return None, None
    try:
        rank = int(header.strip())
    except ValueError:
        rank = -1
    if rank < 0:
        raise SignalError(
            f"{DP_RANK_HEADER} must be a non-negative integer, got {header!r}", DP_RANK_HEADER
        )
    return rank, DP_RANK_HEADER


def _stored_response_rank(payload: dict[str, Any]) -> tuple[int | None, str | None]:
    """A response that continues a stored one goes to the rank that stored it."""
    previous = payload.get("previous_response_id")
    rank = rank_of_response(previous) if isinstance(previous, str) else None
    return (rank, "previous_response_id") if rank is not None else (None, None)


def _routing_key(payload: dict[str, Any], headers: Mapping[str, str]) -> str | None:
    value = payload.get("routing_key")
    if value is not None:
        if not isinstance(value, str):
            raise SignalError(f"routing_key must be a string, got {value!r}", "routing_key")
        return value or None
    return _header(headers, ROUTING_KEY_HEADER) or None


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        value = headers.get(name.lower())
    return value


def routing_text(path: str, payload: Mapping[str, Any]) -> str:
    """A string whose prefixes follow the prompt's: requests that share a prompt prefix share a
    text prefix. Chat messages are their contents, each followed by its role (no role marker in
    front: every request would share it, and unrelated short prompts would look alike); token ids
    become one character each; a batch is routed by its first prompt."""
    if path.endswith("/chat/completions"):
        return _chat_text(payload.get("messages"))
    if path.endswith("/responses"):
        return _responses_text(payload)
    if path.endswith("/completions"):
        return _prompt_text(payload.get("prompt"))
    if path.endswith("/generate"):
        text = payload.get("text")
        return _prompt_text(text if text is not None else payload.get("input_ids"))
    return ""


def _chat_text(messages: Any) -> str:
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict) and p.get("text")
            )
        # The role after the content: it still tells a system prompt from the same user words,
        # without a marker that every conversation starts with.
        role = message.get("role", "")
        parts.append(f"{content if content is not None else ''}{MESSAGE_END}{role}{MESSAGE_END}")
    return "".join(parts)


def _responses_text(payload: Mapping[str, Any]) -> str:
    """A Responses API request as chat's: its instructions are the system message."""
    instructions = payload.get("instructions")
    text = ""
    if isinstance(instructions, str):
        text = f"{instructions}{MESSAGE_END}system{MESSAGE_END}"
    items = payload.get("input")
    if isinstance(items, str):
        return f"{text}{items}{MESSAGE_END}user{MESSAGE_END}"
    return text + _chat_text(items)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return "".join(chr(t % 0x110000) for t in prompt)
        return _prompt_text(prompt[0])
    return ""
