"""Responses API ids that name the data-parallel rank holding the response.

A stored response lives in the memory of the rank that made it, so a request that continues it
(`previous_response_id`) or reads it (`GET /v1/responses/{id}`) must reach that rank. The rank
writes its number into the id; the router reads it back and pins the request there.
"""

from __future__ import annotations

import re
import uuid

PREFIX = "resp_"
_RANKED = re.compile(r"^resp_r(\d{1,6})_[0-9a-f]+$")


def new_response_id(dp_rank: int | None) -> str:
    """A fresh id; with the rank's number when the server is one rank of several."""
    if dp_rank is None:
        return f"{PREFIX}{uuid.uuid4().hex}"
    return f"{PREFIX}r{dp_rank}_{uuid.uuid4().hex}"


def rank_of_response(response_id: str) -> int | None:
    """The rank named in a response id; None for an id without one (or not ours)."""
    match = _RANKED.match(response_id)
    return int(match.group(1)) if match else None
