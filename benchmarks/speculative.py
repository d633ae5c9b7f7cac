"""What n-gram speculative decoding gains and costs: single-stream output tokens/s of
`berth serve --speculative-algorithm ngram` against the same server without it, side by side.

    python -m benchmarks.speculative      # or: make bench-speculative

Two workloads, greedy, one request at a time (where speculation applies):

- rewrite: a ~300-token Python snippet to be repeated with one change (an editing agent's
  everyday request); the answer repeats most of its prompt, which is what prompt lookup drafts;
- chat: everyday questions, whose answers rarely repeat anything: what speculation costs.

Both servers run at once and each round alternates which goes first (A B, then B A), so that the
machine's drift hits both alike; medians over rounds. Every answer of the speculative server is
checked equal to the plain one's: speculation must not change a greedy output. The issue's
targets: at least 2x on rewrite, under 5% lost on chat.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

import httpx

from berth_common.server_process import ServerProcess, berth_server

SNIPPET = '''import json
import os


class ConfigError(Exception):
    """A configuration file that cannot be used."""


def load_config(path):
    """Read a JSON configuration file and check its required fields."""
    if not os.path.exists(path):
        raise ConfigError(f"no such file: {path}")
    with open(path) as f:
        data = json.load(f)
    for field in ("name", "version", "owner"):
        if field not in data:
            raise ConfigError(f"missing field: {field}")
    data.setdefault("retries", 3)
    data.setdefault("timeout", 30)
    return data


def save_config(path, data):
    """Write a configuration back, sorted and indented."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def merge_configs(base, override):
    """A copy of base with every key of override replacing its own."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_configs(merged[key], value)
        else:
            merged[key] = value
    return merged
'''
REWRITES = [
    "Repeat the following code exactly, but rename load_config to read_config.",
    "Repeat the following code exactly, but rename ConfigError to SettingsError.",
    "Repeat the following code exactly, but change indent=2 to indent=4.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about ships.",
    "Give three tips for learning a language.",
    "Why is the sky blue?",
    "Describe a cat in one paragraph.",
]
TARGET_REWRITE, TARGET_CHAT = 2.0, 0.95


def workloads() -> dict[str, list[str]]:
    rewrite = [f"{ask}\n\n```python\n{SNIPPET}```" for ask in REWRITES]
    return {"rewrite": rewrite, "chat": QUESTIONS}


def answer(server: ServerProcess, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    """The greedy answer, its token count and its seconds (one request, nothing else running)."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    start = time.perf_counter()
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    return (
        out["choices"][0]["message"]["content"],
        out["usage"]["completion_tokens"],
        (time.perf_counter() - start),
    )


def spec_counters(server: ServerProcess) -> tuple[float, float]:
    """(draft tokens, accepted tokens) since the server started."""
    text = httpx.get(f"{server.base_url}/metrics").text

    def value(name: str) -> float:
        match = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    return (
        value("berth:spec_decode_num_draft_tokens"),
        value("berth:spec_decode_num_accepted_tokens"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)

    servers = {
        "plain": berth_server("serve", *args.server_args, name="berth-plain"),
        "ngram": berth_server(
            "serve", "--speculative-algorithm", "ngram", *args.server_args, name="berth-ngram"
        ),
    }
    rates: dict[tuple[str, str], list[float]] = {}
    acceptance: dict[str, tuple[float, float]] = {}
    mismatches = 0
    try:
        for server in servers.values():
            server.wait_ready(timeout=600)
        for name, prompts in workloads().items():
            before = spec_counters(servers["ngram"])
            for round_index in range(args.rounds):
                order = ["plain", "ngram"] if round_index % 2 == 0 else ["ngram", "plain"]
                texts: dict[str, list[str]] = {}
                for kind in order:
                    tokens = seconds = 0.0
                    texts[kind] = []
                    for prompt in prompts:
                        text, n, s = answer(servers[kind], prompt, args.max_tokens)
                        texts[kind].append(text)
                        tokens, seconds = tokens + n, seconds + s
                    rates.setdefault((name, kind), []).append(tokens / seconds)
                    print(
                        f"[bench] {name}, round {round_index + 1}, {kind}: "
                        f"{tokens / seconds:.1f} output tok/s ({tokens:.0f} tokens)",
                        file=sys.stderr,
                    )
                mismatches += sum(a != b for a, b in zip(texts["plain"], texts["ngram"]))
            after = spec_counters(servers["ngram"])
            acceptance[name] = (after[0] - before[0], after[1] - before[1])
    finally:
        for server in servers.values():
            server.stop()

    print("\n| Workload | Plain, output tok/s | ngram, output tok/s | Ratio | Drafts accepted |")
    print("|---|---|---|---|---|")
    ratios = {}
    for name in workloads():
        plain = statistics.median(rates[(name, "plain")])
        ngram = statistics.median(rates[(name, "ngram")])
        ratios[name] = ngram / plain
        drafted, accepted = acceptance[name]
        share = f"{accepted / drafted:.0%} of {drafted:.0f}" if drafted else "none drafted"
        print(f"| {name} | {plain:.1f} | {ngram:.1f} | {ratios[name]:.2f}x | {share} |")
    print(f"\nAnswers that differ from plain decoding: {mismatches} (must be 0)")
    print(
        f"Targets: rewrite >= {TARGET_REWRITE}x "
        f"({'met' if ratios['rewrite'] >= TARGET_REWRITE else 'NOT met'}), "
        f"chat >= {TARGET_CHAT}x ({'met' if ratios['chat'] >= TARGET_CHAT else 'NOT met'})"
    )
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
