"""Tool calls read out of a model's text, as far as the text goes: the one reader behind whole
replies (`read_calls`) and streamed ones (`scan_calls`, which `ToolStream` follows).

Each format is read by a small JSON scanner that knows where every value begins and, once it
has, where it ends, so that a call's name is known as soon as its string closes and its arguments
can be sent as the model writes them. The arguments are always the model's own text of a JSON
object (not re-serialized), so a streamed call and a whole one carry the same arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from berth_runtime.entrypoints.tool_calls import ToolPlan

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
LLAMA3_TAG = "<|python_tag|>"
MISTRAL_TAG, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class CallSoFar:
    """One call as far as the text has written it."""

    name: str | None  # None until its string is complete
    arguments: str  # the arguments' text so far; "" until they begin
    object_arguments: bool  # the arguments are (the start of) a JSON object
    complete: bool  # the call's text is whole


@dataclass(frozen=True)
class Scan:
    content_end: int  # where the calls begin (the length of the text when there are none)
    calls: list[CallSoFar]
    broken: bool  # something after content_end is not a call in the format


def read_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    """The content and the tool calls in a choice's whole text; no calls if there are none, or
    if the text is not what the plan expects (a cut-off answer: the text stays content)."""
    if plan.mode == "named":
        assert plan.function is not None
        return (None, [ParsedCall(plan.function, text)]) if _is_json(text) else (text, [])
    scan = scan_calls(plan, text)
    calls = []
    for call in scan.calls:
        if call.name is None or not call.complete or not _is_object(call.arguments):
            return text, []
        calls.append(ParsedCall(call.name, call.arguments))
    if scan.broken or not calls:
        return text, []
    return text[: scan.content_end].strip() or None, calls


def scan_calls(plan: ToolPlan, text: str) -> Scan:
    """The calls in `text` so far, in the format of the plan (`required` or its `auto` parser)."""
    if plan.mode == "required":
        return _scan_array(text)
    reader = {"hermes": _scan_hermes, "llama3": _scan_llama3, "mistral": _scan_mistral}.get(
        plan.parser or ""
    )
    return reader(text) if reader is not None else Scan(len(text), [], False)


# --- the formats ---------------------------------------------------------------------------------


def _scan_array(text: str) -> Scan:
    """`tool_choice: required`: `[{"name": ..., "parameters": {...}}, ...]`."""
    start = _skip_space(text, 0)
    if start == len(text):
        return Scan(0, [], False)
    if text[start] != "[":
        return Scan(0, [], True)
    calls, broken, _ = _scan_objects(text, start + 1, ",", "]", ("parameters",))
    return Scan(0, calls, broken)


def _scan_hermes(text: str) -> Scan:
    """Hermes and Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated."""
    first = text.find(HERMES_START)
    if first < 0:
        return Scan(len(text), [], False)
    calls: list[CallSoFar] = []
    position = first
    while position >= 0:
        body = _skip_space(text, position + len(HERMES_START))
        if body == len(text):
            break
        if text[body] != "{":
            return Scan(first, calls, True)
        call, end = _call_object(text, body, ("arguments",))
        if call is None:
            return Scan(first, calls, True)
        calls.append(call)
        if end is None:
            break
        after = _skip_space(text, end)
        if text.startswith(HERMES_END, after):
            after += len(HERMES_END)
        elif after < len(text) and not HERMES_END.startswith(text[after:]):
            return Scan(first, calls, True)
        position = text.find(HERMES_START, after)
    return Scan(first, calls, False)


def _scan_llama3(text: str) -> Scan:
    """Llama 3.x: `{"name": ..., "parameters": {...}}`, calls separated by `;`, the reply
    opening with the call (after `<|python_tag|>`, if the model writes it)."""
    start = _skip_space(text, 0)
    if LLAMA3_TAG.startswith(text[start:]):  # nothing yet, or a part of the tag
        return Scan(0, [], False)
    if text.startswith(LLAMA3_TAG, start):
        start = _skip_space(text, start + len(LLAMA3_TAG))
        if start == len(text):
            return Scan(0, [], False)
    if text[start] != "{":
        return Scan(len(text), [], False)
    calls, broken, _ = _scan_objects(text, start, ";", None, ("parameters", "arguments"))
    return Scan(0, calls, broken)


def _scan_mistral(text: str) -> Scan:
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or in the newer
    tokenizers `[TOOL_CALLS]name[ARGS]{...}`, one tag per call."""
    first = text.find(MISTRAL_TAG)
    if first < 0:
        return Scan(len(text), [], False)
    calls: list[CallSoFar] = []
    position = first
    while position >= 0:
        part = _skip_space(text, position + len(MISTRAL_TAG))
        following = text.find(MISTRAL_TAG, part)
        stop = following if following >= 0 else len(text)
        if part == stop:
            break
        if text[part] == "[":
            more, broken, end = _scan_objects(text, part + 1, ",", "]", ("arguments",))
            calls += more
            if broken or (end is not None and text[end:stop].strip()):
                return Scan(first, calls, True)
        else:
            name, separator, _ = text[part:stop].partition(MISTRAL_ARGS)
            if not separator:
                if "{" in name or (following >= 0 and MISTRAL_ARGS not in name):
                    return Scan(first, calls, True)
                break  # the name may still be coming
            arguments = _skip_space(text, part + len(name) + len(MISTRAL_ARGS))
            if arguments == len(text):
                calls.append(CallSoFar(name.strip() or None, "", False, False))
                break
            end = _value_end(text, arguments)
            written = text[arguments : end if end is not None else stop]
            calls.append(
                CallSoFar(name.strip() or None, written, written.startswith("{"), end is not None)
            )
            if end is not None and text[end:stop].strip():
                return Scan(first, calls, True)
        position = following
    return Scan(first, calls, False)


# --- the JSON scanner ----------------------------------------------------------------------------


def _scan_objects(
    text: str, position: int, separator: str, closer: str | None, keys: tuple[str, ...]
) -> tuple[list[CallSoFar], bool, int | None]:
    """Call objects one after another from `position`, `separator` between them, up to `closer`
    (or the end of the text): the calls, whether something else came, and where it ended."""
    calls: list[CallSoFar] = []
    while True:
        position = _skip_space(text, position)
        if position == len(text):
            return calls, False, None
        char = text[position]
        if closer is not None and char == closer:
            return calls, False, position + 1
        if char == separator and calls:
            position += 1
            continue
        if char != "{":
            return calls, True, None
        call, end = _call_object(text, position, keys)
        if call is None:
            return calls, True, None
        calls.append(call)
        if end is None:
            return calls, False, None
        position = end


def _call_object(
    text: str, start: int, keys: tuple[str, ...]
) -> tuple[CallSoFar | None, int | None]:
    """The call written by the object at `start` (None if it is not one) and where it ends."""
    members, end = _members(text, start)
    if members is None:
        return None, None
    name = None
    if "name" in members:
        value_start, value_end = members["name"]
        if value_end is not None:
            name = json.loads(text[value_start:value_end])
            if not isinstance(name, str):
                return None, None
    key = next((k for k in keys if k in members), None)
    if key is None:
        arguments = "{}" if end is not None else ""
    else:
        value_start, value_end = members[key]
        arguments = text[value_start : value_end if value_end is not None else len(text)]
    is_object = arguments.startswith("{")
    return CallSoFar(name, arguments, is_object, end is not None), end


def _members(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]] | None, int | None]:
    """The members of the object at `start` as far as they go (key -> where its value starts and
    ends, None while open) and where the object ends; None if it is not an object."""
    members: dict[str, tuple[int, int | None]] = {}
    position = _skip_space(text, start + 1)
    while position < len(text):
        if text[position] == "}" and not members:
            return members, position + 1
        if text[position] != '"':
            return None, None
        key_end = _string_end(text, position)
        if key_end is None:
            return members, None
        key = json.loads(text[position:key_end])
        position = _skip_space(text, key_end)
        if position == len(text):
            return members, None
        if text[position] != ":":
            return None, None
        position = _skip_space(text, position + 1)
        if position == len(text):
            return members, None
        value_end = _value_end(text, position)
        members[key] = (position, value_end)
        if value_end is None:
            return members, None
        position = _skip_space(text, value_end)
        if position == len(text):
            return members, None
        if text[position] == "}":
            return members, position + 1
        if text[position] != ",":
            return None, None
        position = _skip_space(text, position + 1)
    return members, None


_SCALAR = re.compile(r"[^,}\]\s]*")
_STRING_REST = re.compile(r'(?:[^"\\]|\\.)*"', re.S)  # a string after its opening quote
_NESTING = re.compile(r'["{}\[\]]')  # what changes the depth inside an object or array


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value at `start` ends, or None if the text ends first."""
    char = text[start]
    if char == '"':
        return _string_end(text, start)
    if char not in "{[":
        end = _SCALAR.match(text, start).end()  # type: ignore[union-attr]
        return end if end < len(text) else None
    depth, position = 0, start
    while (found := _NESTING.search(text, position)) is not None:
        char, position = found.group(), found.start()
        if char == '"':
            string_end = _string_end(text, position)
            if string_end is None:
                return None
            position = string_end
            continue
        depth += 1 if char in "{[" else -1
        position += 1
        if depth == 0:
            return position
    return None


def _string_end(text: str, start: int) -> int | None:
    found = _STRING_REST.match(text, start + 1)
    return found.end() if found is not None else None


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
