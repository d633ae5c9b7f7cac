"""SamplingParams: how to pick each next token and when to stop; validated once at the API edge."""

from __future__ import annotations

import msgspec

from berth_runtime.constrained.spec import GRAMMAR_KINDS, GrammarSpec

# A temperature below this is treated as greedy decoding.
GREEDY_EPS = 1e-6


class SamplingParamsError(ValueError):
    """An invalid sampling field; `param` names the field for the OpenAI error body."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Sampling and stopping rules of one request (one choice)."""

    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    seed: int | None = None
    # Constrained decoding (SGLang's names): at most one of a JSON schema (as JSON text), a
    # regular expression, or an EBNF grammar (xgrammar's dialect of GBNF).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def grammar(self) -> GrammarSpec | None:
        """The grammar the output must match, if any (`verify` allows at most one)."""
        for kind in GRAMMAR_KINDS:
            source = getattr(self, kind)
            if source is not None:
                return GrammarSpec(kind, source)
        return None

    def normalized(self) -> SamplingParams:
        """A copy with stop strings deduplicated, empty ones dropped, and greedy made explicit."""
        stop = list(dict.fromkeys(s for s in self.stop if s))
        params = msgspec.structs.replace(self, stop=stop)
        if params.temperature < GREEDY_EPS:
            params = msgspec.structs.replace(params, temperature=0.0, top_k=1, top_p=1.0, min_p=0.0)
        return params

    def verify(self, vocab_size: int) -> None:
        """Raise SamplingParamsError naming the first invalid field."""
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise SamplingParamsError(
                f"max_tokens must be at least 0, got {self.max_new_tokens}", "max_tokens"
            )
        if self.min_new_tokens < 0:
            raise SamplingParamsError("min_tokens must be at least 0", "min_tokens")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise SamplingParamsError("min_tokens must not exceed max_tokens", "min_tokens")
        if not 0.0 <= self.temperature <= 2.0 + GREEDY_EPS:
            raise SamplingParamsError(
                f"temperature must be in [0, 2], got {self.temperature}", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1 or self.top_k == 0:
            raise SamplingParamsError(
                f"top_k must be -1 (disabled) or at least 1, got {self.top_k}", "top_k"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {value}", name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingParamsError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
                "repetition_penalty",
            )
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise SamplingParamsError(
                    f"stop_token_ids contains {token_id}, outside the vocabulary [0, {vocab_size})",
                    "stop_token_ids",
                )
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise SamplingParamsError(
                f"give at most one of json_schema, regex and ebnf, not {' and '.join(given)}",
                given[1],
            )
        for token_id, bias in self.logit_bias.items():
            if not 0 <= token_id < vocab_size:
                raise SamplingParamsError(
                    f"logit_bias key {token_id} is outside the vocabulary [0, {vocab_size})",
                    "logit_bias",
                )
            if not -100.0 <= bias <= 100.0:
                raise SamplingParamsError(
                    f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias"
                )
