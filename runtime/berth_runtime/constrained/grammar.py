"""Grammar-constrained decoding on xgrammar: a request's grammar, its check at the API edge, its
compilation in the scheduler (cached by key, on a worker thread) and its per-request matcher.

A request asks for at most one of SGLang's sampling parameters `json_schema`, `regex` or `ebnf`
(`GrammarSpec`). The API process parses it before anything is queued, so that a bad one is a 400
with xgrammar's own message; the scheduler compiles it against the vocabulary (the costly part:
a token mask cache for every grammar state) on its grammar thread, and a request joins the
queue once its grammar is ready. While it decodes, each step fills one bitmask row per
constrained request, applies them to the logits in one call, and advances each matcher past the
token the sampler chose.

JSON is generated compact (`{"a": 1, "b": [2, 3]}`): with free whitespace between tokens, a small
model at a high temperature can pad a document with newlines until it runs out of tokens.

xgrammar was chosen over llguidance by measurement (`benchmarks/grammar_backends.py`): per token
it fills a mask in about a fifth of the time, and its compiled grammars are cached by key.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from berth_runtime.constrained.spec import GrammarSpec

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar's errors start with "[time] file.cc:line: " and sometimes a failed check's text.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# Compiled grammars kept in memory (xgrammar's own cache, by grammar text).
CACHE_LIMIT_BYTES = 256 * 2**20


def _xgr():
    """xgrammar, imported on first use: about 40 MB of the scheduler's memory (it imports
    transformers' tokenizer code) that a server serving no constrained request never needs."""
    import xgrammar

    return xgrammar


class GrammarError(ValueError):
    """A grammar that cannot be parsed or compiled; the message is xgrammar's, cleaned."""


def clean_message(error: BaseException) -> str:
    """The first line of xgrammar's message, without its log prefix."""
    lines = str(error).strip().splitlines()
    return _LOG_PREFIX.sub("", lines[0]) if lines else ""


def check_grammar(spec: GrammarSpec) -> None:
    """Parse the grammar without the vocabulary (fast); raise GrammarError if it is invalid."""
    try:
        if spec.kind == "json_schema":
            _xgr().Grammar.from_json_schema(spec.source, any_whitespace=False)
        elif spec.kind == "regex":
            _xgr().Grammar.from_regex(spec.source)
        elif spec.kind == "ebnf":
            _xgr().Grammar.from_ebnf(spec.source)
        else:
            raise GrammarError(f"unknown grammar kind {spec.kind!r}")
    except GrammarError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError (and a few others) with its message
        raise GrammarError(clean_message(e)) from None


class GrammarCompiler:
    """Compiles grammars against one vocabulary, on its own thread, each distinct one once.

    The vocabulary is read when the first grammar arrives, on that thread (as vLLM builds its
    grammar backend): xgrammar's copy of it and its compiler take about 40 MB, which a server
    that serves no constrained request never spends. `make_info` gives it."""

    def __init__(self, make_info: Callable[[], xgr.TokenizerInfo]) -> None:
        self._make_info = make_info
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="berth-grammar")

    @classmethod
    def for_model(
        cls, model_path: str, vocab_size: int, stop_token_ids: Iterable[int]
    ) -> GrammarCompiler:
        """For the Hugging Face tokenizer of `model_path`, loaded with the vocabulary;
        `vocab_size` is the model's (its logits' width)."""
        stop = sorted(stop_token_ids)

        def make_info() -> xgr.TokenizerInfo:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path)
            return _xgr().TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stop
            )

        return cls(make_info)

    def submit(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        return self._pool.submit(self.compile, spec)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Compile on the calling thread (`submit`'s, in the scheduler)."""
        if self._compiler is None:
            self._compiler = _xgr().GrammarCompiler(
                self._make_info(),
                max_threads=1,
                cache_enabled=True,
                cache_limit_bytes=CACHE_LIMIT_BYTES,
            )
        try:
            if spec.kind == "json_schema":
                return self._compiler.compile_json_schema(spec.source, any_whitespace=False)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.source)
            if spec.kind == "ebnf":
                return self._compiler.compile_grammar(spec.source)
        except Exception as e:
            raise GrammarError(clean_message(e)) from None
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")


class Matcher:
    """One request's position in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = _xgr().GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def finished(self) -> bool:
        """The grammar has ended (a stop token was accepted after a complete match)."""
        return bool(self._matcher.is_terminated())


def apply_grammars(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> None:
    """Mask, in place, every token that row i's grammar does not allow next (rows without a
    matcher are left as they are); one bitmask for the whole batch, one call to apply it."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    bitmask = _xgr().allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill(bitmask, i)  # type: ignore[union-attr]
    _xgr().apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
