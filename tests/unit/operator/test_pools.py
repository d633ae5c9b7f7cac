"""AcceleratorPools without a cluster: Node matching, the merge of a pool into a spec, placement,
the quota ledger's decisions, and the pool's status."""

from __future__ import annotations

import io
from typing import Any

import pytest
import yaml

from berth_operator import cli, pool_status
from berth_operator.nodes import NodeView, matching, quantity_units
from berth_operator.pool_placement import (
    POOL_CONFLICT,
    POOL_NOT_ALLOWED,
    POOL_NOT_FOUND,
    POOL_TOO_SMALL,
    PlacementError,
    PoolView,
    both_affinities,
    place,
)
from berth_operator.quota import Claim, Ledger
from berth_operator.spec import InferenceService, SpecError
from berth_operator.spec.pool import AcceleratorPool
from tests.unit.operator.factories import (
    K8S_VERSIONS,
    REPO_ROOT,
    isvc_body,
    load_yaml_docs,
    validate_strict,
    validation_errors,
)

NOW = "2026-12-05T00:00:00Z"


def pool_body(name: str, spec: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.berth.dev/v1alpha1",
        "kind": "AcceleratorPool",
        "metadata": {"name": name, "generation": 1},
        "spec": {**(spec or {}), **fields},
    }


def pool(name: str, spec: dict[str, Any] | None = None, **fields: Any) -> AcceleratorPool:
    return AcceleratorPool.from_body(pool_body(name, spec, **fields))


def node(
    name: str,
    gpus: str = "8",
    labels: dict[str, str] | None = None,
    *,
    taints: list[dict[str, str]] | None = None,
    ready: bool = True,
    unschedulable: bool = False,
    resource: str = "nvidia.com/gpu",
) -> NodeView:
    return NodeView.of(
        {
            "metadata": {"name": name, "labels": labels or {}},
            "spec": {"taints": taints or [], "unschedulable": unschedulable},
            "status": {
                "allocatable": {resource: gpus, "cpu": "32"},
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }
    )


def service(
    spec: dict[str, Any],
    *,
    name: str = "chat",
    namespace: str = "team-a",
    created: str = "2026-12-01T00:00:00Z",
) -> tuple[dict[str, Any], InferenceService]:
    body = isvc_body(spec, name=name, namespace=namespace)
    body["metadata"]["creationTimestamp"] = created
    return body, InferenceService.from_body(body)


def view(
    pools: list[dict[str, Any]],
    nodes: list[NodeView] = (),  # type: ignore[assignment]
    labels: dict[str, dict[str, str]] | None = None,
) -> PoolView:
    by_name = {p["metadata"]["name"]: p for p in pools}
    return PoolView(lambda: by_name, lambda ns: (labels or {}).get(ns, {}), lambda: list(nodes))


# --- nodes ---


def test_quantities_in_whole_units() -> None:
    assert [quantity_units(q) for q in ("8", "1500m", "2k", "0", "nonsense")] == [
        8,
        1,
        2000,
        0,
        0,
    ]


def test_a_node_matches_by_labels_affinity_taints_and_readiness() -> None:
    spec = pool(
        "h100",
        nodeSelector={"gpu": "h100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": ["special"]}
                            ]
                        },
                    ]
                }
            }
        },
    ).spec
    gpu_taint = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
    other_taint = {"key": "maintenance", "value": "x", "effect": "NoExecute"}
    nodes = [
        node("ok", labels={"gpu": "h100", "zone": "a"}, taints=[gpu_taint]),
        node("special", labels={"gpu": "h100"}),
        node("wrong-zone", labels={"gpu": "h100", "zone": "b"}),
        node("wrong-label", labels={"gpu": "l4", "zone": "a"}),
        node("tainted", labels={"gpu": "h100", "zone": "a"}, taints=[other_taint]),
        node("not-ready", labels={"gpu": "h100", "zone": "a"}, ready=False),
        node("cordoned", labels={"gpu": "h100", "zone": "a"}, unschedulable=True),
        node(
            "soft",
            labels={"gpu": "h100", "zone": "a"},
            taints=[{"key": "x", "effect": "PreferNoSchedule"}],
        ),
    ]
    assert [n.name for n in matching(spec, nodes)] == ["ok", "soft", "special"]


# --- the pool's own spec ---


def test_a_pool_refuses_unknown_locks_pod_affinity_and_empty_namespace_sets() -> None:
    with pytest.raises(SpecError) as e:
        pool(
            "p",
            locked=["image", "args.dtype", "replicas"],
            affinity={"podAffinity": {}},
            limits={"namespaces": [{"maxAccelerators": 1}], "allowedNamespaces": {}},
        )
    text = str(e.value)
    assert "spec.locked[2]: 'replicas' is not one of image, env," in text
    assert "spec.affinity.podAffinity: unknown field (known here: nodeAffinity)" in text
    empty = "an empty set selects no namespace"
    assert f"spec.limits.namespaces[0]: name namespaces, or give matchLabels: {empty}" in text
    assert f"spec.limits.allowedNamespaces: name namespaces, or give matchLabels: {empty}" in text


def test_the_crd_refuses_what_the_pool_parser_refuses() -> None:
    crd = yaml.safe_load(
        (REPO_ROOT / "crds" / "serving.berth.dev_acceleratorpools.yaml").read_text()
    )
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    bad = [
        {"locked": ["replicas"]},
        {"limits": {"namespaces": [{"maxAccelerators": 1}]}},
        {"limits": {"allowedNamespaces": {"names": []}}},
        {"accelerator": {"resource": "gpu"}},
    ]
    for spec in bad:
        with pytest.raises(SpecError):
            pool("p", spec)
        assert validation_errors(schema, pool_body("p", spec)), spec
    assert (
        validation_errors(
            schema, pool_body("p", {"limits": {"allowedNamespaces": {"names": ["a"]}}})
        )
        == []
    )


def test_a_service_with_pools_may_not_set_gpus_itself() -> None:
    with pytest.raises(SpecError, match="with pools, each pool decides the accelerators"):
        service({"pools": [{"name": "h100"}], "resources": {"gpus": 1}})


# --- merge ---


H100 = pool_body(
    "h100",
    accelerator={"resource": "nvidia.com/gpu", "perRank": 1},
    nodeSelector={"gpu": "h100"},
    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    priorityClassName="gpu-serving",
    defaults={
        "image": "reg/berth:cuda",
        "args": {"dtype": "bfloat16", "contextLength": 8192},
        "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        "sharedMemory": "16Gi",
    },
    locked=["image", "args.dtype"],
)
L4 = pool_body(
    "l4",
    accelerator={"resource": "nvidia.com/gpu", "perRank": 2},
    nodeSelector={"gpu": "l4"},
)


def placed(spec: dict[str, Any], pools: list[dict[str, Any]], **kwargs: Any) -> Any:
    body, isvc = service(spec)
    ledger = kwargs.pop("ledger", Ledger())
    return place(body, isvc, view(pools, **kwargs), ledger, isvc.spec.ranks)


def test_pool_defaults_fill_what_the_service_leaves_unset_and_its_own_values_win() -> None:
    p = placed(
        {
            "pools": [{"name": "h100", "args": {"maxRunningRequests": 64}}],
            "runtime": {"args": {"contextLength": 2048}, "env": [{"name": "MINE", "value": "1"}]},
            "scheduling": {"nodeSelector": {"zone": "a"}},
        },
        [H100],
    )
    spec = p.isvc.spec
    assert [(r.pool, r.per_rank, r.start, r.count) for r in p.rank_sets] == [("h100", 1, 0, 1)]
    assert spec.runtime.image == "reg/berth:cuda"
    assert spec.runtime.args.dtype == "bfloat16"
    assert spec.runtime.args.context_length == 2048  # the service's own
    assert spec.runtime.args.max_running_requests == 64  # the per-pool override
    assert [e["name"] for e in spec.runtime.env] == ["MINE", "NCCL_DEBUG"]
    assert spec.resources.shared_memory == "16Gi"
    assert (spec.resources.gpus, spec.resources.gpu_resource) == (1, "nvidia.com/gpu")
    assert dict(spec.scheduling.node_selector) == {"gpu": "h100", "zone": "a"}
    assert spec.scheduling.priority_class_name == "gpu-serving"
    assert spec.scheduling.tolerations[0]["key"] == "nvidia.com/gpu"
    assert [r.name for r in spec.pools] == ["h100"]  # the service's own list stays


def test_a_locked_field_set_otherwise_skips_the_pool_with_both_values_named() -> None:
    with pytest.raises(PlacementError) as e:
        placed(
            {
                "pools": [{"name": "h100"}],
                "runtime": {"image": "mine:1", "args": {"dtype": "float32"}},
            },
            [H100],
        )
    assert e.value.reason == POOL_CONFLICT
    assert "image is locked to 'reg/berth:cuda'; runtime.image sets 'mine:1'" in e.value.message
    assert (
        "args.dtype is locked to 'bfloat16'; runtime.args.dtype sets 'float32'" in e.value.message
    )
    # Setting a locked field to the pool's own value is fine.
    ok = placed({"pools": [{"name": "h100"}], "runtime": {"image": "reg/berth:cuda"}}, [H100])
    assert ok.isvc.spec.runtime.image == "reg/berth:cuda"


def test_a_locked_per_rank_count_refuses_another() -> None:
    locked = pool_body("h100", accelerator={"perRank": 1}, locked=["acceleratorsPerRank"])
    with pytest.raises(PlacementError, match="acceleratorsPerRank is locked to 1"):
        placed({"pools": [{"name": "h100", "acceleratorsPerRank": 2}]}, [locked])


def test_a_cpu_pool_sets_cores_and_no_gpu() -> None:
    cpu = pool_body(
        "cpu", accelerator={"resource": "cpu", "perRank": 2}, defaults={"args": {"device": "cpu"}}
    )
    p = placed({"pools": [{"name": "cpu"}]}, [cpu])
    assert (p.isvc.spec.resources.gpus, p.isvc.spec.resources.cpu) == (0, "2")
    assert p.isvc.spec.runtime.args.device == "cpu"


def test_node_affinities_of_pool_and_service_both_hold() -> None:
    def term(key: str) -> dict[str, Any]:
        return {"matchExpressions": [{"key": key, "operator": "Exists"}]}

    def affinity(*terms: dict[str, Any]) -> dict[str, Any]:
        required = {"nodeSelectorTerms": list(terms)}
        return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}

    merged = both_affinities(
        affinity(term("a"), term("b")), {**affinity(term("c")), "podAntiAffinity": {"x": 1}}
    )
    assert merged is not None and merged["podAntiAffinity"] == {"x": 1}
    terms = merged["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    keys = [[e["key"] for e in t["matchExpressions"]] for t in terms]
    assert keys == [["a", "c"], ["b", "c"]]  # (a or b) and c


# --- which pool ---


def test_refusals_name_every_pool_and_nothing_is_reserved() -> None:
    closed = pool_body("closed", limits={"allowedNamespaces": {"names": ["team-b"]}})
    tiny = pool_body("tiny", accelerator={"perRank": 4}, limits={"maxAccelerators": 2})
    ledger = Ledger()
    with pytest.raises(PlacementError) as e:
        placed(
            {"pools": [{"name": "missing"}, {"name": "closed"}, {"name": "tiny"}]},
            [closed, tiny],
            ledger=ledger,
        )
    assert e.value.reason == POOL_NOT_FOUND
    assert "pool missing: no AcceleratorPool of that name" in e.value.message
    assert "pool closed: namespace team-a may not use it (allowed: team-b)" in e.value.message
    assert (
        "pool tiny: a rank needs 4 nvidia.com/gpu, over limits.maxAccelerators 2" in e.value.message
    )
    assert ledger.reserved == {}


def test_a_namespace_is_admitted_by_label_and_a_rank_must_fit_on_a_node() -> None:
    labelled = pool_body("gpu", limits={"allowedNamespaces": {"matchLabels": {"team": "ml"}}})
    body, isvc = service({"pools": [{"name": "gpu"}]})
    p = place(body, isvc, view([labelled], labels={"team-a": {"team": "ml"}}), Ledger(), 1)
    assert p.grant.pools == (("gpu", 1),)
    with pytest.raises(PlacementError) as e:
        place(body, isvc, view([labelled], labels={"team-a": {"team": "web"}}), Ledger(), 1)
    assert e.value.reason == POOL_NOT_ALLOWED
    with pytest.raises(PlacementError) as e:
        placed(
            {"pools": [{"name": "gpu", "acceleratorsPerRank": 16}]},
            [pool_body("gpu")],
            nodes=[node("n", "8")],
        )
    assert e.value.reason == POOL_TOO_SMALL
    assert "its largest node has 8" in e.value.message


def test_ranks_fill_the_first_pool_with_room_then_the_next() -> None:
    h100 = pool_body("h100", limits={"maxAccelerators": 2})
    l4 = pool_body("l4", accelerator={"perRank": 2}, limits={"maxAccelerators": 4})
    spec = {"pools": [{"name": "h100"}, {"name": "l4"}], "replicas": 3}
    p = placed(spec, [h100, l4])
    assert [(r.pool, r.index, r.start, r.count) for r in p.rank_sets] == [
        ("h100", 0, 0, 2),
        ("l4", 1, 2, 1),
    ]
    assert p.rank_sets[1].isvc.spec.resources.gpus == 2  # each set has its own pool's settings
    assert (p.grant.ranks, p.grant.short) == (3, False)
    p = placed({**spec, "replicas": 5}, [h100, l4])  # 2 + 2 fit, the fifth waits
    assert (p.grant.pools, p.grant.ranks, p.grant.wanted) == ((("h100", 2), ("l4", 2)), 4, 5)
    assert p.grant.limit == (
        "pool h100: limits.maxAccelerators is 2; pool l4: limits.maxAccelerators is 4; "
        "4 of 5 ranks fit"
    )


def claims_of(p: Any, namespace: str = "team-a", name: str = "chat") -> list[Claim]:
    return [Claim(namespace, name, r.pool, r.count * r.per_rank, r.start) for r in p.rank_sets]


def test_running_ranks_stay_where_they_are_and_the_last_rank_set_changes() -> None:
    h100 = pool_body("h100", limits={"maxAccelerators": 2})
    l4 = pool_body("l4")
    pools = [{"name": "h100"}, {"name": "l4"}]
    running: list[Claim] = [Claim("team-a", "chat", "l4", 2, 0)]  # placed when h100 was full
    ledger = Ledger(observed=lambda: running)
    p = placed({"pools": pools, "replicas": 4}, [h100, l4], ledger=ledger)
    # l4's set grows (it holds the highest ranks); h100 is not used while l4 has room.
    assert [(r.pool, r.start, r.count) for r in p.rank_sets] == [("l4", 0, 4)]
    running[:] = claims_of(p)
    crowded = pool_body("l4", limits={"maxAccelerators": 4})
    p = placed({"pools": pools, "replicas": 6}, [h100, crowded], ledger=ledger)
    assert [(r.pool, r.index, r.start, r.count) for r in p.rank_sets] == [
        ("l4", 0, 0, 4),
        ("h100", 1, 4, 2),
    ]
    running[:] = claims_of(p)
    # Fewer ranks come off the top: the last set first.
    p = placed({"pools": pools, "replicas": 5}, [h100, crowded], ledger=ledger)
    assert [(r.pool, r.start, r.count) for r in p.rank_sets] == [("l4", 0, 4), ("h100", 4, 1)]
    p = placed({"pools": pools, "replicas": 3}, [h100, crowded], ledger=ledger)
    assert [(r.pool, r.start, r.count) for r in p.rank_sets] == [("l4", 0, 3)]


# --- the ledger ---


def decide(
    ledger: Ledger,
    pools: list[dict[str, Any]],
    namespace: str,
    name: str,
    wanted: int,
    *,
    created: str = "2026-12-01T00:00:00Z",
    labels: dict[str, dict[str, str]] | None = None,
) -> Any:
    body, isvc = service(
        {"pools": [{"name": p["metadata"]["name"]} for p in pools]},
        name=name,
        namespace=namespace,
        created=created,
    )
    return place(body, isvc, view(pools, labels=labels), ledger, wanted).grant


def test_per_namespace_and_pool_limits_hold_for_services_deciding_one_after_another() -> None:
    gpu = pool_body(
        "gpu",
        limits={
            "maxAccelerators": 6,
            "namespaces": [
                {"names": ["team-a"], "maxAccelerators": 4},
                {"matchLabels": {"tier": "free"}, "maxAccelerators": 1},
            ],
        },
    )
    ledger = Ledger()
    a1 = decide(ledger, [gpu], "team-a", "one", 3, created="1")
    a2 = decide(ledger, [gpu], "team-a", "two", 3, created="2")
    b = decide(ledger, [gpu], "team-b", "three", 5, created="3")
    free = decide(
        ledger, [gpu], "team-c", "four", 2, created="4", labels={"team-c": {"tier": "free"}}
    )
    assert (a1.ranks, a2.ranks, b.ranks, free.ranks) == (3, 1, 2, 0)
    assert "limits.namespaces[0].maxAccelerators is 4 for namespace team-a" in (a2.limit or "")
    assert "limits.maxAccelerators is 6" in (b.limit or "")
    assert sum(ledger.claims("gpu").values()) == 6


def test_a_lowered_limit_keeps_running_ranks_and_adds_none() -> None:
    running = [Claim("team-a", "chat", "gpu", 4)]
    ledger = Ledger(observed=lambda: running)
    lowered = pool_body("gpu", limits={"maxAccelerators": 2})
    assert decide(ledger, [lowered], "team-a", "chat", 4).ranks == 4
    grown = decide(ledger, [lowered], "team-a", "chat", 6)
    assert (grown.ranks, grown.short) == (4, True)
    assert decide(ledger, [lowered], "team-b", "new", 1).ranks == 0
    # Even below one rank's count, the pool stays the service's (no PoolTooSmall, no move).
    tiny = pool_body("gpu", accelerator={"perRank": 2}, limits={"maxAccelerators": 1})
    running[:] = [Claim("team-a", "chat", "gpu", 4)]
    assert decide(Ledger(observed=lambda: running), [tiny], "team-a", "chat", 2).pools == (
        ("gpu", 2),
    )


def test_room_that_frees_up_goes_to_the_oldest_waiting_service() -> None:
    claims: list[Claim] = [Claim("team-z", "big", "gpu", 4)]
    ledger = Ledger(observed=lambda: claims)
    gpu = pool_body("gpu", limits={"maxAccelerators": 4})
    old, young = "2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z"
    assert decide(ledger, [gpu], "team-a", "old", 2, created=old).ranks == 0
    assert decide(ledger, [gpu], "team-b", "young", 2, created=young).ranks == 0
    claims[:] = [Claim("team-z", "big", "gpu", 2)]  # big scaled down: 2 free
    # The younger service asks first, but the room is the older one's.
    assert decide(ledger, [gpu], "team-b", "young", 2, created=young).ranks == 0
    assert decide(ledger, [gpu], "team-a", "old", 2, created=old).ranks == 2
    assert decide(ledger, [gpu], "team-b", "young", 2, created=young).ranks == 0
    ledger.release(("team-a", "old"))
    claims.clear()
    assert decide(ledger, [gpu], "team-b", "young", 2, created=young).ranks == 2


def test_a_service_waiting_on_its_own_namespace_limit_does_not_hold_back_others() -> None:
    gpu = pool_body(
        "gpu",
        limits={"maxAccelerators": 4, "namespaces": [{"names": ["team-a"], "maxAccelerators": 1}]},
    )
    ledger = Ledger()
    assert decide(ledger, [gpu], "team-a", "old", 3, created="1").ranks == 1
    assert decide(ledger, [gpu], "team-b", "young", 3, created="2").ranks == 3


# --- the pool's status ---


def test_status_counts_matching_nodes_claims_and_says_when_over_committed() -> None:
    gpu = pool(
        "gpu",
        nodeSelector={"gpu": "h100"},
        limits={"maxAccelerators": 6, "namespaces": [{"names": ["team-a"], "maxAccelerators": 4}]},
    )
    nodes = [node("a", "8", {"gpu": "h100"}), node("b", "4", {"gpu": "h100"}), node("c", "8")]
    claims = {("team-a", "chat"): 4, ("team-b", "code"): 2}
    status = pool_status.compute(gpu, nodes, claims, lambda ns: {}, None, NOW)
    assert (status["nodes"], status["allocatable"], status["claimed"]) == (2, 12, 6)
    assert status["namespaces"] == [
        {"namespace": "team-a", "claimed": 4, "limit": 4},
        {"namespace": "team-b", "claimed": 2},
    ]
    assert status["services"] == ["team-a/chat", "team-b/code"]
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conditions == {
        "NodesAvailable": ("True", "NodesMatch"),
        "OverCommitted": ("False", "WithinCapacity"),
    }
    # Nodes went away: over-committed; a limit lowered under running ranks: over the limit.
    gone = pool_status.compute(gpu, nodes[2:], claims, lambda ns: {}, status, NOW)
    conditions = {c["type"]: (c["status"], c["reason"]) for c in gone["conditions"]}
    assert conditions == {
        "NodesAvailable": ("False", "NoMatchingNodes"),
        "OverCommitted": ("True", "OverAllocatable"),
    }
    lowered = pool("gpu", nodeSelector={"gpu": "h100"}, limits={"maxAccelerators": 4})
    over = pool_status.compute(lowered, nodes, claims, lambda ns: {}, status, NOW)
    assert (
        next(c for c in over["conditions"] if c["type"] == "OverCommitted")["reason"] == "OverLimit"
    )


# --- berth operator render ---


def test_render_shows_the_children_as_placed_in_the_pool(tmp_path: Any) -> None:
    pools = tmp_path / "pools.yaml"
    pools.write_text(yaml.safe_dump_all([H100, L4]))
    isvc = tmp_path / "isvc.yaml"
    isvc.write_text(yaml.safe_dump(service({"pools": [{"name": "h100"}, {"name": "l4"}]})[0]))
    out, err = io.StringIO(), io.StringIO()
    assert cli.render([str(isvc)], "default:1", None, out, err, pool_files=[str(pools)]) == 0, (
        err.getvalue()
    )
    statefulset = next(d for d in yaml.safe_load_all(out.getvalue()) if d["kind"] == "StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    assert statefulset["metadata"]["labels"]["serving.berth.dev/pool"] == "h100"
    assert pod["containers"][0]["image"] == "reg/berth:cuda"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"gpu": "h100"}
    out, err = io.StringIO(), io.StringIO()
    assert cli.render([str(isvc)], "default:1", None, out, err) == 1
    assert "PoolNotFound" in err.getvalue() and out.getvalue() == ""


POOL_SAMPLES = REPO_ROOT / "manifests" / "samples" / "pools"
POOLS_ISVC = REPO_ROOT / "manifests" / "samples" / "with-pools"


def test_the_samples_render_in_each_pool_in_turn_and_are_valid_kubernetes(tmp_path: Any) -> None:
    pools = [d for p in sorted(POOL_SAMPLES.glob("serving_*.yaml")) for d in load_yaml_docs(p)]
    assert sorted(p["metadata"]["name"] for p in pools) == ["cpu", "gpu", "mig-3g-40gb"]
    for body in pools:
        AcceleratorPool.from_body(body)
    (isvc_path,) = POOLS_ISVC.glob("serving_*.yaml")
    placed_in = []
    for left in (pools, [p for p in pools if p["metadata"]["name"] != "mig-3g-40gb"]):
        pool_file = tmp_path / "pools.yaml"
        pool_file.write_text(yaml.safe_dump_all(left))
        out, err = io.StringIO(), io.StringIO()
        code = cli.render(
            [str(isvc_path)], "img:1", "team-a", out, err, pool_files=[str(pool_file)]
        )
        assert code == 0, err.getvalue()
        children = list(yaml.safe_load_all(out.getvalue()))
        for child in children:
            for version in K8S_VERSIONS:
                validate_strict(child, version)
        statefulset = next(d for d in children if d["kind"] == "StatefulSet")
        placed_in.append(statefulset["metadata"]["labels"]["serving.berth.dev/pool"])
    assert placed_in == ["mig-3g-40gb", "gpu"]
