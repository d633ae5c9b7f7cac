"""Tool calling on the chat endpoint: what `tool_choice` asks of decoding, and which format the
tool calls are read back in (`tool_parsers` reads them; `tool_stream` streams them).

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
from dataclasses import dataclass, field
from typing import Any, Literal

from berth_common.errors import RequestError
from berth_runtime.constrained.spec import GrammarSpec
from berth_runtime.entrypoints.tool_parsers import HERMES_START, LLAMA3_TAG, MISTRAL_TAG

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

Mode = Literal["none", "auto", "required", "named"]


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
