"""Stored responses: the last `--max-stored-responses` of them, in memory, for
`previous_response_id` and `GET /v1/responses/{id}`.

Each entry keeps the response and the conversation that led to it, its own answer included, as
chat messages: a response that continues it starts from there. The store is bounded by count, and
by size through the context length (a conversation longer than it cannot be continued anyway);
the oldest entry goes first. It lives in one rank's memory and is gone when the rank restarts.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from berth_common.errors import RequestError
from berth_runtime.entrypoints.protocol import ChatMessage
from berth_runtime.entrypoints.protocol_responses import ResponseObject


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[ChatMessage]  # every message so far, this response's answer included


class ResponseStore:
    """A bounded map from response id to its stored response, oldest evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; a 404 naming it (400 as a request's `param`) when there is none."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise self._not_found(response_id, param)
        return entry

    def delete(self, response_id: str) -> None:
        if self._entries.pop(response_id, None) is None:
            raise self._not_found(response_id, None)

    def _not_found(self, response_id: str, param: str | None) -> RequestError:
        # As OpenAI: a missing previous response is the request's fault (400), a missing
        # response to read or delete a 404.
        if param is not None:
            return RequestError(
                f"Previous response with id '{response_id}' not found.",
                param=param,
                code="previous_response_not_found",
            )
        return RequestError(
            f"No response with id '{response_id}' found (responses are kept in memory, the "
            f"last {self.capacity}).",
            404,
            err_type="NotFoundError",
            code="response_not_found",
        )
