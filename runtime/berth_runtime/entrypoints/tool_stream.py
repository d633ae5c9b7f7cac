"""One streamed choice's tool calls, sent as OpenAI streams them: content as it comes, then each
call's id and name as soon as its name is written, and its arguments piece by piece as the model
writes them.

Text that may begin a call (Hermes' `<tool_call>`, Mistral's `[TOOL_CALLS]`, or a part of either
at the end; a Llama 3 reply that opens with `{`; all of `required`'s array) is never sent as
content. A call is begun once its name is complete and its arguments have opened as a JSON
object; from then on the choice is committed to tool calls. If no call has begun when the choice
stops, its text is read whole (`read_calls`): calls if it reads as calls, content if not.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from berth_runtime.entrypoints.tool_parsers import (
    HERMES_START,
    MISTRAL_TAG,
    CallSoFar,
    Scan,
    read_calls,
    scan_calls,
)

if TYPE_CHECKING:
    from berth_runtime.entrypoints.tool_calls import ToolPlan


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallPiece:
    """A piece of tool call `index`: its first piece carries the call's id and name."""

    index: int
    arguments: str
    call_id: str | None = None
    name: str | None = None


class ToolStream:
    """The text of one streamed choice, split into content and tool call pieces."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # everything so far
        self.sent = 0  # characters of `text` sent as content (named: as arguments)
        self._arguments_sent: list[int] = []  # per begun call: characters of its arguments sent

    @property
    def calls_begun(self) -> int:
        return len(self._arguments_sent)

    def feed(self, delta: str) -> tuple[str, list[CallPiece]]:
        """Take a text delta; return the content and the call pieces that can be sent now."""
        self.text += delta
        if self.plan.mode == "named":
            return "", self._named_pieces()
        scan = scan_calls(self.plan, self.text)
        end = self._content_end(scan)
        content, self.sent = self.text[self.sent : end], max(self.sent, end)
        return content, self._pieces(scan.calls)

    def end(self, clean: bool) -> tuple[str, list[CallPiece]]:
        """At the choice's end (`clean`: it stopped, rather than being cut at a length): the
        content still to send and the calls' last pieces."""
        if self.plan.mode == "named":
            return "", []
        scan = scan_calls(self.plan, self.text)
        if self.calls_begun:  # committed: finish the begun calls, and on a stop the rest
            self.sent = len(self.text)
            return "", self._pieces(scan.calls if clean else scan.calls[: self.calls_begun])
        _, calls = read_calls(self.plan, self.text) if clean else (None, [])
        if not calls:  # plain text after all: what was held back is content
            rest, self.sent = self.text[self.sent :], len(self.text)
            return rest, []
        rest = self.text[self.sent : scan.content_end].rstrip()
        self.sent = len(self.text)
        return rest, self._pieces(scan.calls)

    def _content_end(self, scan: Scan) -> int:
        """Where the text that must wait begins: the calls, a part of a call's tag at the end,
        and the white space before them (a reply with calls ends its content without it)."""
        text, end = self.text, scan.content_end
        tag = {"hermes": HERMES_START, "mistral": MISTRAL_TAG}.get(self.plan.parser or "")
        if tag is not None and end == len(text):
            for size in range(min(len(tag) - 1, len(text)), 0, -1):
                if tag.startswith(text[-size:]):
                    end -= size
                    break
        while end > self.sent and text[end - 1].isspace():
            end -= 1
        return end

    def _pieces(self, calls: list[CallSoFar]) -> list[CallPiece]:
        """The pieces not sent yet of the calls so far, in order; a call begins only after the
        one before it has."""
        pieces = []
        for index, call in enumerate(calls):
            if index < self.calls_begun:
                sent = self._arguments_sent[index]
                if len(call.arguments) > sent:
                    pieces.append(CallPiece(index, call.arguments[sent:]))
                    self._arguments_sent[index] = len(call.arguments)
                continue
            if call.name is None or not call.object_arguments:
                break
            pieces.append(CallPiece(index, call.arguments, new_call_id(), call.name))
            self._arguments_sent.append(len(call.arguments))
        return pieces

    def _named_pieces(self) -> list[CallPiece]:
        """A function named by `tool_choice`: the whole text is its arguments, sent as they come
        (the first piece names the call, even before any argument is written)."""
        new, self.sent = self.text[self.sent :], len(self.text)
        if not self.calls_begun:
            self._arguments_sent.append(0)
            return [CallPiece(0, new, new_call_id(), self.plan.function)]
        return [CallPiece(0, new)] if new else []
