"""Reasoning models' thinking, split from their answer (`--reasoning-parser`): the text between
`<think>` and `</think>` becomes `reasoning_content` in chat completions (streamed as deltas of
its own) and a `reasoning` item in the Responses API; what follows `</think>` is the answer.

- `qwen3` (Qwen3, QwQ): thinking only where the model opens it with `<think>`, or where the
  prompt already did (templates that end the generation prompt with `<think>`); with
  `chat_template_kwargs: {"enable_thinking": false}` the template closes an empty think block
  in the prompt and the whole output is the answer.
- `deepseek-r1` (DeepSeek-R1 and its distills): the output is thinking until `</think>`, whether
  or not the model wrote the opening tag (its template opens it in the prompt).

An output cut off before `</think>` is all thinking, with no answer.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    # The output starts inside the thinking even when neither the prompt nor the output opens it.
    thinking_by_default: bool


REASONING_PARSERS = {
    "qwen3": ReasoningFormat("qwen3", thinking_by_default=False),
    "deepseek-r1": ReasoningFormat("deepseek-r1", thinking_by_default=True),
}


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether the prompt's end (its last few tokens, decoded) leaves a `<think>` open."""
    return prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)


def split_reasoning(
    fmt: ReasoningFormat, text: str, prompt_opened: bool
) -> tuple[str | None, str | None]:
    """A whole output as (reasoning, answer); None where there is none."""
    stream = ReasoningStream(fmt, prompt_opened)
    reasoning, answer = stream.feed(text)
    more_reasoning, more_answer = stream.finish()
    reasoning, answer = reasoning + more_reasoning, answer + more_answer
    return (reasoning.strip() or None) if stream.thought else None, answer or None


class ReasoningStream:
    """One choice's text as it streams, split into thinking and answer deltas. Text that may be
    the start of a tag (`<thi` at the end of a delta) waits for the next delta."""

    def __init__(self, fmt: ReasoningFormat, prompt_opened: bool) -> None:
        # Where the output starts when it does not open with `<think>` itself.
        self.starts_thinking = prompt_opened or fmt.thinking_by_default
        self.phase = "opening"  # -> thinking -> separating -> answering
        self.thought = self.starts_thinking  # whether the output had a thinking part
        self.pending = ""  # text held back: a possible tag, or whitespace after `</think>`

    def feed(self, delta: str) -> tuple[str, str]:
        """(thinking, answer) text that can be sent now."""
        text = self.pending + delta
        self.pending = ""
        thinking = answer = ""
        if self.phase == "opening":
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                self.phase, self.thought = "thinking", True
                text = stripped[len(THINK_START) :]
            elif THINK_START.startswith(stripped):  # maybe the tag, not all here yet
                self.pending = text
                return "", ""
            else:
                self.phase = "thinking" if self.starts_thinking else "answering"
        if self.phase == "thinking":
            end = text.find(THINK_END)
            if end < 0:
                keep = _partial_tag_at_end(text, THINK_END)
                self.pending = text[len(text) - keep :] if keep else ""
                return text[: len(text) - keep], ""
            thinking, text = text[:end], text[end + len(THINK_END) :]
            self.phase = "separating"
        if self.phase == "separating":  # the whitespace between `</think>` and the answer
            text = text.lstrip()
            if not text:
                return thinking, ""
            self.phase = "answering"
        answer = text
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """At the choice's end: what was held back."""
        rest, self.pending = self.pending, ""
        if self.phase == "thinking":
            return rest, ""
        if self.phase == "opening":
            return (rest, "") if self.starts_thinking else ("", rest)
        return "", ""


def _partial_tag_at_end(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
