"""N-gram (prompt lookup) drafts for speculative decoding, with no draft model.

A request's next tokens often repeat something already in its context: code being edited, a
document being quoted, a list being reformatted. The draft for a request is what followed the
latest earlier occurrence of its last n tokens (the longest n from `max_ngram` down to
`min_ngram` that occurred before). The scheduler verifies a draft in one forward pass and keeps
the longest prefix that greedy decoding would have produced itself, plus the token that decoding
picks after it (see `Scheduler._execute_verify`).

Each request keeps its tokens and an index from n-gram to where it last ended, both extended by
the tokens that arrived since the last draft, so a draft costs a few dictionary lookups however
long the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """One request's n-grams (every n in [min_ngram, max_ngram]) -> where each last ended, for
    those with at least one token after them."""

    min_ngram: int
    max_ngram: int
    tokens: list[int] = field(default_factory=list)  # the prompt, then the output so far
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in `ends`

    def propose(self, prompt: list[int], output: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        possible tail of the request's tokens (`prompt`, then `output`, which only grows);
        [] if none did."""
        tokens = self.tokens
        if len(tokens) < len(prompt):
            tokens.extend(prompt[len(tokens) :])
        tokens.extend(output[len(tokens) - len(prompt) :])
        self._catch_up(tokens)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) <= n:
                continue
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + limit]
        return []

    def _catch_up(self, tokens: list[int]) -> None:
        # An n-gram ending at `end` is indexed once a token follows it (end < len(tokens)); later
        # occurrences overwrite earlier ones, so a lookup finds the latest.
        for end in range(max(self.indexed, self.min_ngram), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.ends[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens))
