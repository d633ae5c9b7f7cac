"""GrammarSpec: what a request's output must match (light: no grammar engine imported)."""

from __future__ import annotations

from dataclasses import dataclass

# SGLang's sampling parameter names, in the order they are looked at.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    """`kind` is one of GRAMMAR_KINDS; `source` the schema (JSON text), regular expression or EBNF
    grammar. Also the compiled grammar's cache key."""

    kind: str
    source: str
