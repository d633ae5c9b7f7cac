"""Seeded synthetic workloads whose prompts have an exact token count under the served tokenizer.

Prompts are built from real vocabulary words (tokens that are a space plus letters and decode and
re-encode to themselves), so a prompt of N words is N tokens for the completions API. For the chat
API the rendered chat template (what the server prefills) is fitted to the requested length. Every
request carries `prompt_ids`, the exact ids the server will see, so in-process baselines can run the
very same tokens.

Workloads:

* `random`: input and output lengths fixed (`256`) or uniform in a range (`128:512`).
* `shared-prefix`: groups of prompts that share a long system prefix plus a unique question.
* `chat`: 48-token chat prompts (template included) with 128 output tokens, as in the targets.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Api = Literal["chat", "completions"]
APIS: tuple[str, ...] = ("chat", "completions")
WORKLOADS: tuple[str, ...] = ("random", "shared-prefix", "chat")
EMBEDDED_MODEL = "builtin://smollm2-135m-instruct"


@dataclass
class BenchRequest:
    """One request of a workload: what to send and what the server will prefill."""

    prompt: str  # the completions prompt, or the chat user message
    prompt_ids: list[int]  # the exact ids the server prefills (chat: the rendered template)
    output_len: int
    messages: list[dict[str, str]] | None = None  # chat API only
    group: int = 0  # shared-prefix group (0 otherwise)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def load_tokenizer(path: str | None = None) -> Any:
    """The tokenizer the prompts are counted with: `path`, or the embedded model's."""
    from transformers import AutoTokenizer

    if path is None:
        from berth_runtime.models.loader import resolve_model

        path = resolve_model(EMBEDDED_MODEL).path
    return AutoTokenizer.from_pretrained(path)


def parse_len_range(value: str | int) -> tuple[int, int]:
    """`"48"` -> (48, 48); `"32:64"` -> (32, 64), both inclusive."""
    text = str(value).strip()
    lo_text, sep, hi_text = text.partition(":")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if sep else lo
    except ValueError as err:
        raise ValueError(f"a length is N or MIN:MAX, got {value!r}") from err
    if lo < 1 or hi < lo:
        raise ValueError(f"a length range needs 1 <= MIN <= MAX, got {value!r}")
    return lo, hi


@functools.lru_cache(maxsize=8)
def _word_pool_cached(tokenizer: Any) -> tuple[int, ...]:
    vocab = tokenizer.get_vocab()
    candidates = sorted(
        token_id
        for token, token_id in vocab.items()
        # Byte-level BPE spells a leading space as "Ġ"; SentencePiece as "▁".
        if token[:1] in ("Ġ", "▁")
        and len(token) > 2
        and token[1:].isascii()
        and token[1:].isalpha()
    )
    texts = [tokenizer.decode([token_id]) for token_id in candidates]
    pool = tuple(
        token_id
        for token_id, text in zip(candidates, texts)
        if tokenizer.encode(text, add_special_tokens=False) == [token_id]
    )
    if len(pool) < 100:
        raise ValueError("the tokenizer has too few round-trip-stable word tokens for prompts")
    return pool


def word_pool(tokenizer: Any) -> tuple[int, ...]:
    """Token ids that are a space plus letters and re-encode to themselves (sorted, cached)."""
    return _word_pool_cached(tokenizer)


def _words(rng: random.Random, pool: tuple[int, ...], n: int) -> list[int]:
    return [pool[rng.randrange(len(pool))] for _ in range(n)]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The ids a server prefills for `messages`: the rendered template with the generation prompt,
    tokenized without adding special tokens again (as Berth and SGLang do)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def completion_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The ids a server prefills for a completions prompt string."""
    return list(tokenizer.encode(prompt))


def _fit(
    render: Callable[[list[int]], tuple[str, list[int]]],
    words: Callable[[int], list[int]],
    target: int,
    overhead: int,
) -> tuple[str, list[int]]:
    """Choose how many words make `render` produce exactly `target` ids."""
    n = target - overhead
    seen: set[int] = set()
    for _ in range(16):
        if n < 1:
            break
        text, ids = render(words(n))
        if len(ids) == target:
            return text, ids
        seen.add(n)
        n += target - len(ids)
        if n in seen:
            n += 1 if len(ids) < target else -1
    raise ValueError(
        f"cannot build a prompt of exactly {target} tokens (the template alone takes {overhead})"
    )


def make_request(
    tokenizer: Any,
    rng: random.Random,
    input_len: int,
    output_len: int,
    api: Api,
    system: str | None = None,
) -> BenchRequest:
    """One request whose prefilled prompt is exactly `input_len` tokens."""
    pool = word_pool(tokenizer)
    drawn = _words(rng, pool, input_len + 16)

    def words(n: int) -> list[int]:
        return drawn[:n] if n <= len(drawn) else drawn + _words(rng, pool, n - len(drawn))

    if api == "completions":
        if system is not None:
            raise ValueError("a completions prompt has no system message")
        overhead = len(completion_ids(tokenizer, ""))

        def render(ids: list[int]) -> tuple[str, list[int]]:
            text = tokenizer.decode(ids)
            return text, completion_ids(tokenizer, text)

        text, ids = _fit(render, words, input_len, overhead)
        return BenchRequest(prompt=text, prompt_ids=ids, output_len=output_len)

    def messages_for(content: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": system}] if system is not None else []
        return [*head, {"role": "user", "content": content}]

    def render_chat(ids: list[int]) -> tuple[str, list[int]]:
        text = tokenizer.decode(ids)
        return text, chat_ids(tokenizer, messages_for(text))

    overhead = len(chat_ids(tokenizer, messages_for("")))
    text, ids = _fit(render_chat, words, input_len, overhead)
    return BenchRequest(
        prompt=text, prompt_ids=ids, output_len=output_len, messages=messages_for(text)
    )


def random_workload(
    tokenizer: Any,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    api: Api = "chat",
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_prompts` prompts of uniformly drawn exact lengths (fixed when MIN == MAX)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        requests.append(make_request(tokenizer, rng, n_in, n_out, api))
    return requests


def shared_prefix_workload(
    tokenizer: Any,
    num_groups: int,
    prompts_per_group: int,
    prefix_len: int,
    question_len: int,
    output_len: tuple[int, int],
    api: Api = "chat",
    seed: int = 0,
) -> list[BenchRequest]:
    """Groups of prompts sharing a `prefix_len`-token prefix (chat: the system message) followed
    by a unique `question_len`-token question; ordered group by group."""
    rng = random.Random(seed)
    pool = word_pool(tokenizer)
    requests = []
    for group in range(num_groups):
        prefix_ids = _words(rng, pool, prefix_len)
        prefix = tokenizer.decode(prefix_ids)
        for _ in range(prompts_per_group):
            question_ids = _words(rng, pool, question_len)
            question = tokenizer.decode(question_ids)
            n_out = rng.randint(*output_len)
            if api == "completions":
                text = prefix + question
                request = BenchRequest(
                    prompt=text,
                    prompt_ids=completion_ids(tokenizer, text),
                    output_len=n_out,
                    group=group,
                )
            else:
                messages = [
                    {"role": "system", "content": prefix},
                    {"role": "user", "content": question},
                ]
                request = BenchRequest(
                    prompt=question,
                    prompt_ids=chat_ids(tokenizer, messages),
                    output_len=n_out,
                    messages=messages,
                    group=group,
                )
            request.extra = {"prefix_len": prefix_len, "question_len": question_len}
            requests.append(request)
    return requests


def chat_workload(
    tokenizer: Any,
    num_prompts: int,
    input_len: tuple[int, int] = (48, 48),
    output_len: tuple[int, int] = (128, 128),
    seed: int = 0,
) -> list[BenchRequest]:
    """Short chat prompts (48 tokens with the template by default) over the chat API."""
    return random_workload(tokenizer, num_prompts, input_len, output_len, "chat", seed)


def build_workload(
    name: str,
    tokenizer: Any,
    num_prompts: int,
    api: Api = "chat",
    input_len: tuple[int, int] | None = None,
    output_len: tuple[int, int] | None = None,
    seed: int = 0,
    prefix_len: int = 2000,
    question_len: int = 32,
    num_groups: int = 1,
) -> list[BenchRequest]:
    """The workload called `name`; None lengths take that workload's defaults."""
    if name == "random":
        return random_workload(
            tokenizer, num_prompts, input_len or (256, 256), output_len or (128, 128), api, seed
        )
    if name == "chat":
        if api != "chat":
            raise ValueError("the chat workload uses the chat API")
        return chat_workload(
            tokenizer, num_prompts, input_len or (48, 48), output_len or (128, 128), seed
        )
    if name == "shared-prefix":
        if num_groups < 1 or num_prompts < num_groups:
            raise ValueError("shared-prefix needs 1 <= --num-groups <= --num-prompts")
        if num_prompts % num_groups:
            raise ValueError("--num-prompts must be a multiple of --num-groups")
        return shared_prefix_workload(
            tokenizer,
            num_groups,
            num_prompts // num_groups,
            prefix_len,
            question_len,
            output_len or (128, 128),
            api,
            seed,
        )
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


# The structured-output workload's default schema: a list of records of the kind applications ask
# for (strings, an enum, bounded integers, a nested array), long enough to be measured.
RECORDS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 6,
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "city": {"enum": ["Paris", "Rome", "Madrid", "Lisbon", "Oslo"]},
                    "score": {"type": "integer", "minimum": 0, "maximum": 100},
                    "tags": {
                        "type": "array",
                        "maxItems": 3,
                        "items": {"enum": ["new", "vip", "late", "paid"]},
                    },
                },
                "required": ["name", "city", "score", "tags"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}


def json_schema_format(source: str) -> dict[str, Any]:
    """`response_format` for `--json-schema`: `builtin` (RECORDS_SCHEMA), a file, or JSON text."""
    if source == "builtin":
        schema = RECORDS_SCHEMA
    elif source.lstrip().startswith("{"):
        schema = json.loads(source)
    else:
        with open(source, encoding="utf-8") as f:
            schema = json.load(f)
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
