"""Tool calling on the chat endpoint: what `tool_choice` asks of decoding, and the tool calls read
back out of a choice's text, whole or while it streams.

- `required`: the output is constrained to a JSON array of one or more calls,
  `[{"name": ..., "parameters": {...}}]`, each call's parameters matching its function's schema
  (one call only with `parallel_tool_calls: false`). Works with any model.
- a named function: the output is constrained to that function's arguments.
- `auto`: the model decides; a parser (`--tool-call-parser`) recognises calls in its text:
  `hermes` (Hermes, Qwen: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`) or
  `llama3` (Llama 3.x: `{"name": ..., "parameters": ...}`, calls separated by `;`) or `mistral`
  (`[TOOL_CALLS][{"name": ..., "arguments": ...}]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`).
  Unless `--tool-call-parser` names one (or `none`), it is chosen from the chat template: the
  format the template teaches the model (`detect_parser`). Without a parser, `auto` answers text.
- `none`: text, with the tools still shown to the model through the chat template.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from berth_common.errors import RequestError
from berth_runtime.constrained.spec import GrammarSpec

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
LLAMA3_TAG = "<|python_tag|>"
MISTRAL_TAG, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""

    mode: Mode
    function: str | None = None  # the named function
    parser: str | None = None  # `auto` only
    parallel: bool = True
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> parameters schema

    def grammar(self) -> GrammarSpec | None:
        if self.mode == "named":
            assert self.function is not None
            return GrammarSpec("json_schema", json.dumps(self.tools[self.function]))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, parameters in self.tools.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return GrammarSpec("json_schema", json.dumps(array))

    @property
    def parses(self) -> bool:
        """Whether a choice's text is read back as tool calls."""
        return self.mode in ("required", "named") or (self.mode == "auto" and bool(self.parser))


def plan_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel: bool,
    parser: str | None,
) -> ToolPlan:
    """The ToolPlan of a request's `tools`, `tool_choice` and `parallel_tool_calls`; a 400 naming
    `tool_choice` when it asks for a tool that is not there."""
    schemas = {tool.function.name: tool.function.parameters or NO_ARGUMENTS for tool in tools or []}
    if len(schemas) != len(tools or []):
        raise RequestError("tools must have distinct function names", param="tools")
    choice = tool_choice if tool_choice is not None else ("auto" if schemas else "none")
    if isinstance(choice, str):
        if choice in ("required", "auto") and not schemas:
            raise RequestError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        mode: Mode = choice  # type: ignore[assignment]
        return ToolPlan(
            mode, parser=parser if mode == "auto" else None, parallel=parallel, tools=schemas
        )
    name = choice.function.name
    if name not in schemas:
        raise RequestError(
            f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    return ToolPlan("named", function=name, parallel=parallel, tools=schemas)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    """The content and the tool calls in a choice's whole text; no calls if there are none, or
    if the text is not what the plan expects (a cut-off answer: the text stays content)."""
    if plan.mode == "named":
        assert plan.function is not None
        return (None, [ParsedCall(plan.function, text)]) if _is_json(text) else (text, [])
    if plan.mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:
            return text, []
        return None, [ParsedCall(c["name"], json.dumps(c["parameters"])) for c in calls]
    if plan.parser == "hermes":
        return _read_hermes(text)
    if plan.parser == "llama3":
        return _read_llama3(text)
    if plan.parser == "mistral":
        return _read_mistral(text)
    return text, []


def effective_parser(flag: str | None, chat_template: str | None) -> str | None:
    """The parser a server uses: --tool-call-parser's (`none`: no parser), or, unset, the one
    its chat template calls for."""
    if flag is not None:
        return None if flag == "none" else flag
    return detect_parser(chat_template)


def detect_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, or None: Qwen's and Hermes'
    `<tool_call>` tags, Mistral's `[TOOL_CALLS]`, Llama 3.1+'s JSON with `parameters`."""
    template = chat_template or ""
    if HERMES_START in template:
        return "hermes"
    if MISTRAL_TAG in template:
        return "mistral"
    if LLAMA3_TAG in template or '"parameters": dictionary of argument name' in template:
        return "llama3"
    return None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


_HERMES_CALL = re.compile(re.escape(HERMES_START) + r"(.*?)" + re.escape(HERMES_END), re.S)


def _read_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES_CALL.findall(text[start:]):
        call = _call_from_json(body, "arguments")
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def _read_llama3(text: str) -> tuple[str | None, list[ParsedCall]]:
    body = text.strip().removeprefix(LLAMA3_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    position = 0
    while position < len(body):
        try:
            obj, end = decoder.raw_decode(body, position)
        except ValueError:
            return text, []
        call = _call_from_object(obj, "parameters") or _call_from_object(obj, "arguments")
        if call is None:
            return text, []
        calls.append(call)
        position = end
        while position < len(body) and body[position] in " \n\t;":
            position += 1
    return None, calls


def _read_mistral(text: str) -> tuple[str | None, list[ParsedCall]]:
    start = text.find(MISTRAL_TAG)
    if start < 0:
        return text, []
    content = text[:start].strip() or None
    calls: list[ParsedCall] = []
    for part in text[start:].split(MISTRAL_TAG)[1:]:
        part = part.strip()
        if part.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
            try:
                objects = json.loads(part)
            except ValueError:
                return text, []
            if not isinstance(objects, list):
                return text, []
            parsed = [_call_from_object(obj, "arguments") for obj in objects]
        else:  # name[ARGS]{...}
            name, separator, arguments = part.partition(MISTRAL_ARGS)
            try:
                obj = {"name": name.strip(), "arguments": json.loads(arguments)}
            except ValueError:
                return text, []
            parsed = [_call_from_object(obj, "arguments") if separator and name.strip() else None]
        if not parsed or any(call is None for call in parsed):
            return text, []
        calls += [call for call in parsed if call is not None]
    return (content, calls) if calls else (text, [])


def _call_from_json(body: str, arguments_key: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _call_from_object(obj, arguments_key)


def _call_from_object(obj: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments))


class ToolStream:
    """One streamed choice's text, split into content to send now and tool calls to send once
    they are complete.

    `named` streams its arguments as they are generated. Otherwise text that may begin a call
    (`required`: all of it; `hermes` and `mistral`: from their tag, `<tool_call>` or
    `[TOOL_CALLS]`, or a prefix of it at the end; `llama3`: a reply that opens with `{`) is held
    back until the choice ends, then sent as the calls it parses into, or as content if it does
    not parse.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # everything so far
        self.sent = 0  # characters of `text` sent as content (or as named arguments)
        self.call_id = new_call_id() if plan.mode == "named" else None
        self.started = False  # a named call's first delta (id, name) was sent

    def feed(self, delta: str) -> str:
        """Take a text delta; return what can be sent now (content, or named arguments)."""
        self.text += delta
        keep = self._held_from()
        out, self.sent = self.text[self.sent : keep], max(self.sent, keep)
        return out

    def _held_from(self) -> int:
        """Where the text that must wait for the end begins."""
        mode, text = self.plan.mode, self.text
        if mode == "named":
            return len(text)
        if mode == "required":
            return 0
        tag = {"hermes": HERMES_START, "mistral": MISTRAL_TAG}.get(self.plan.parser or "")
        if tag is not None:
            start = text.find(tag)
            if start >= 0:
                return start
            for size in range(min(len(tag) - 1, len(text)), 0, -1):
                if tag.startswith(text[-size:]):
                    return len(text) - size
            return len(text)
        if self.plan.parser == "llama3":
            opening = text.lstrip()
            if not opening or opening.startswith(("{", LLAMA3_TAG[: len(opening)])):
                return 0
        return len(text)

    def flush(self) -> str:
        """At an end that is not a clean stop (a length cut): what was held back, as content."""
        rest, self.sent = self.text[self.sent :], len(self.text)
        return rest if self.plan.mode != "named" else ""

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the choice's end: content still to send, and the calls (named: none; its call was
        streamed)."""
        if self.plan.mode == "named":
            return "", []
        _, calls = read_calls(self.plan, self.text)
        end = len(self.text) if not calls else self._held_from()
        rest = self.text[self.sent : end]
        self.sent = len(self.text)
        return (rest.rstrip() if calls else rest), calls
