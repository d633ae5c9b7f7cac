"""Choose a grammar engine by measurement: xgrammar against llguidance, side by side in one run.

    python -m benchmarks.grammar_backends        # or: make bench-grammar

On the embedded model's tokenizer, for a few JSON schemas of the kind typed clients send, it
measures what constrained decoding costs the scheduler: building the tokenizer's tables (once per
server), compiling a grammar (once per distinct schema, then cached), and per generated token the
two calls on the hot path, filling the next token's bitmask and advancing past the chosen token.
The tokens are those of a valid answer, so the matcher walks the whole grammar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from berth_runtime.models.loader import resolve_model

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat object": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "admin": {"type": "boolean"},
            },
            "required": ["name", "age", "admin"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "admin": True},
    ),
    "nested, enum, array": (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "country": {"enum": ["France", "Italy", "Spain"]},
                "landmarks": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "year": {"type": "integer"},
                        },
                        "required": ["name", "year"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["city", "country", "landmarks"],
            "additionalProperties": False,
        },
        {
            "city": "Paris",
            "country": "France",
            "landmarks": [
                {"name": "Eiffel Tower", "year": 1889},
                {"name": "Arc de Triomphe", "year": 1836},
                {"name": "Sacre-Coeur", "year": 1914},
            ],
        },
    ),
}


@dataclass(frozen=True)
class Timing:
    backend: str
    schema: str
    compile_ms: float
    fill_us: float  # per token, median
    accept_us: float  # per token, median
    tokens: int


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def run_xgrammar(tokenizer: Any, vocab_size: int) -> tuple[float, list[Timing]]:
    import torch
    import xgrammar as xgr

    info, setup = timed(
        lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    out = []
    for name, (schema, answer) in SCHEMAS.items():
        compiled, compile_s = timed(lambda s=schema: compiler.compile_json_schema(json.dumps(s)))
        matcher = xgr.GrammarMatcher(compiled)
        fills, accepts = [], []
        tokens = tokenizer.encode(json.dumps(answer), add_special_tokens=False)
        for token in tokens:
            _, fill_s = timed(lambda m=matcher: m.fill_next_token_bitmask(bitmask, 0))
            ok, accept_s = timed(lambda m=matcher, t=token: m.accept_token(t))
            assert ok, f"xgrammar refused token {token} of a valid answer"
            fills.append(fill_s)
            accepts.append(accept_s)
        assert torch.is_tensor(bitmask)
        out.append(timing("xgrammar", name, compile_s, fills, accepts))
    return setup, out


def run_llguidance(tokenizer: Any, vocab_size: int) -> tuple[float, list[Timing]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    ll_tokenizer, setup = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size))
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    out = []
    for name, (schema, answer) in SCHEMAS.items():

        def compile_one(s: dict[str, Any] = schema) -> Any:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s))
            return llguidance.LLMatcher(ll_tokenizer, grammar)

        matcher, compile_s = timed(compile_one)
        assert not matcher.is_error(), matcher.get_error()
        fills, accepts = [], []
        tokens = tokenizer.encode(json.dumps(answer), add_special_tokens=False)
        for token in tokens:
            _, fill_s = timed(
                lambda m=matcher: llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)
            )
            ok, accept_s = timed(lambda m=matcher, t=token: m.consume_token(t))
            assert ok, f"llguidance refused token {token}: {matcher.get_error()}"
            fills.append(fill_s)
            accepts.append(accept_s)
        out.append(timing("llguidance", name, compile_s, fills, accepts))
    return setup, out


def timing(backend: str, schema: str, compile_s: float, fills: list, accepts: list) -> Timing:
    return Timing(
        backend,
        schema,
        compile_s * 1000,
        statistics.median(fills) * 1e6,
        statistics.median(accepts) * 1e6,
        len(fills),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    args = parser.parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    path = str(resolve_model(args.model).path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    results = [run_xgrammar(tokenizer, vocab_size), run_llguidance(tokenizer, vocab_size)]
    print(f"\n{path}: vocabulary of {vocab_size:,} tokens; one CPU thread each\n")
    print("| Engine | Schema | Tokenizer tables | Compile | Mask fill / token | Accept / token |")
    print("|---|---|---|---|---|---|")
    for setup, timings in results:
        for t in timings:
            print(
                f"| {t.backend} | {t.schema} ({t.tokens} tokens) | {setup * 1000:,.0f} ms | "
                f"{t.compile_ms:,.1f} ms | {t.fill_us:,.0f} us | {t.accept_us:,.0f} us |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
