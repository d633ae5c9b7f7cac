"""Detokenizer: turn each request's new token ids into text, UTF-8 safe and stop-string aware."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from berth_runtime.io_struct import BatchOutput, FinishReason
from berth_runtime.utils.token_bytes import incomplete_tail


@dataclass
class DecodeState:
    """Incremental decoding state of one request."""

    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # start of the context window that is decoded again
    read_offset: int = 0  # ids before this are already in `text`
    text: str = ""  # decoded text so far (may include a stop string not yet cut)
    sent: int = 0  # characters of `text` already emitted
    stopped: bool = False  # a stop string was found: nothing more is emitted


class IncrementalDetokenizer:
    """Decodes token ids incrementally per request; never emits a partial UTF-8 character, and never
    emits text that may turn out to be the start of a stop string."""

    def __init__(
        self,
        decode: Callable[[list[int], bool], str],
        token_bytes: Sequence[bytes] = (),
    ) -> None:
        self.decode = decode  # (ids, skip_special_tokens) -> text
        # Each token id's bytes: a text that ends when its last character is not complete
        # (max_tokens reached mid-character) drops that part instead of ending in U+FFFD.
        self.token_bytes = token_bytes
        self.states: dict[str, DecodeState] = {}

    def step(
        self,
        rid: str,
        new_ids: list[int],
        finish: FinishReason | None,
        stop_strs: list[str],
        skip_special_tokens: bool,
    ) -> str:
        """Return the text delta to emit for `rid` after appending `new_ids`."""
        state = self.states.setdefault(rid, DecodeState())
        if state.stopped:
            if finish is not None:
                del self.states[rid]
            return ""
        if finish is not None and finish.type == "stop" and finish.matched_token is not None:
            # A stop token ends the text; it is not part of it.
            new_ids = new_ids[:-1] if new_ids and new_ids[-1] == finish.matched_token else new_ids
        state.ids.extend(new_ids)
        self._advance(state, skip_special_tokens, flush=finish is not None)

        end = len(state.text)
        stopped = False
        if stop_strs:
            # Search only where a new match can start: just before what was already emitted.
            search_from = max(0, state.sent - max(len(s) for s in stop_strs) + 1)
            hits = [state.text.find(s, search_from) for s in stop_strs]
            hits = [h for h in hits if h >= 0]
            if hits:
                end = min(hits)
                stopped = True
            elif finish is None:
                end -= _partial_stop_suffix(state.text, stop_strs)
        if stopped:
            state.text = state.text[:end]
            state.stopped = True
        end = max(end, state.sent)
        delta = state.text[state.sent : end]
        state.sent = end
        if finish is not None:
            del self.states[rid]
        return delta

    def _advance(self, state: DecodeState, skip_special_tokens: bool, flush: bool) -> None:
        # Decode the already-read tokens again together with the new ones, and take the difference:
        # byte-level tokens only render correctly next to their neighbours.
        prefix_text = self.decode(
            state.ids[state.prefix_offset : state.read_offset], skip_special_tokens
        )
        full_text = self.decode(state.ids[state.prefix_offset :], skip_special_tokens)
        if len(full_text) <= len(prefix_text):
            return
        if full_text.endswith("\ufffd"):
            if not flush:
                return  # an incomplete UTF-8 sequence: wait for the next token
            if self._ends_mid_character(state.ids):
                full_text = full_text[:-1]  # the request ended inside a character
        state.text += full_text[len(prefix_text) :]
        state.prefix_offset = state.read_offset
        state.read_offset = len(state.ids)

    def _ends_mid_character(self, ids: list[int]) -> bool:
        vocab = self.token_bytes
        tail = b"".join(vocab[i] for i in ids[-3:] if i < len(vocab))
        return incomplete_tail(tail) > 0


def _partial_stop_suffix(text: str, stop_strs: list[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stop_strs:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def detokenize_batch(detok: IncrementalDetokenizer, batch: BatchOutput) -> BatchOutput:
    """Fill in each output's text: the delta its new token ids add (in place; returned)."""
    for out in batch.outputs:
        out.text = detok.step(
            out.rid,
            out.new_token_ids,
            out.finish_reason,
            out.stop_strs,
            out.skip_special_tokens,
        )
    return batch
