"""The router benchmark's workload and defaults (the run itself needs real ranks)."""

from __future__ import annotations

from collections import defaultdict

from benchmarks.router import build_parser, shared_prefix_workload


def test_workload_is_groups_of_prompts_sharing_a_long_prefix_and_nothing_else() -> None:
    jobs = shared_prefix_workload(groups=4, per_group=5, prefix_words=50, seed=1)
    assert len(jobs) == 20
    by_group: dict[int, list[str]] = defaultdict(list)
    for job in jobs:
        by_group[job.group].append(job.prompt)
    assert sorted(len(p) for p in by_group.values()) == [5, 5, 5, 5]
    prefixes = {}
    for group, prompts in by_group.items():
        prefix = prompts[0][: prompts[0].index("Question")]
        assert all(p.startswith(prefix) for p in prompts)
        assert len(set(prompts)) == len(prompts)  # distinct questions
        assert len(prefix.split()) > 50
        prefixes[group] = prefix
    # Different groups share only their opening words, not the manual.
    assert len(set(prefixes.values())) == 4
    assert [j.group for j in jobs] != sorted(j.group for j in jobs)  # shuffled
    assert jobs == shared_prefix_workload(groups=4, per_group=5, prefix_words=50, seed=1)


def test_defaults_compare_cache_aware_with_round_robin() -> None:
    args = build_parser().parse_args([])
    assert args.policies == ["cache_aware", "round_robin"] and args.ranks == 3
