"""AcceleratorPools on the real control plane: kwok Nodes with GPUs, kube-scheduler placing the
rank pods on them, the operator on its own ServiceAccount.

Each test makes its own pools (cluster-scoped, named per test) and deletes them; the Nodes are
shared by the module, tainted so that only pools that tolerate them place ranks there.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from berth_operator import constants as c
from tests.cluster.controlplane import KWOK_NODE_ANNOTATION, REPO_ROOT, ControlPlane
from tests.cluster.helpers import (
    apply,
    condition,
    events,
    eventually,
    get,
    isvc,
    pods,
    rank_selector,
    wait_condition,
    wait_ready,
)

GPU = "nvidia.com/gpu"
TAINT_KEY = "berth.test/pool"
# Two H100-like nodes with 2 GPUs each, one L4-like node with 4.
NODES = {"bt-h100-0": ("h100", 2), "bt-h100-1": ("h100", 2), "bt-l4-0": ("l4", 4)}


@pytest.fixture(scope="module")
def gpu_nodes(installed: ControlPlane) -> Iterator[dict[str, tuple[str, int]]]:
    key, value = KWOK_NODE_ANNOTATION
    items = [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {key: value},
                "labels": {"kubernetes.io/hostname": name, "type": "kwok", "berth.test/gpu": kind},
            },
            "spec": {"taints": [{"key": TAINT_KEY, "value": kind, "effect": "NoSchedule"}]},
            "status": {
                "allocatable": {"cpu": "32", "memory": "256Gi", "pods": "110", GPU: str(gpus)},
                "capacity": {"cpu": "32", "memory": "256Gi", "pods": "110", GPU: str(gpus)},
            },
        }
        for name, (kind, gpus) in NODES.items()
    ]
    installed.kubectl(
        "create", "-f", "-", stdin=json.dumps({"kind": "List", "apiVersion": "v1", "items": items})
    )

    def ready() -> bool:
        nodes = json.loads(installed.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        return all(
            any(
                cd["type"] == "Ready" and cd["status"] == "True"
                for cd in n["status"].get("conditions", [])
            )
            for n in nodes
            if n["metadata"]["name"] in NODES
        )

    eventually(ready, what="the GPU nodes to be Ready")
    # The nodes stay for the rest of the package (tainted: only pool ranks go there). Deleting
    # them, even drained, left kube-scheduler or the StatefulSet controller slow to act on a
    # later test's pods now and then; a cluster's nodes do not come and go per test either.
    yield NODES


def pool(name: str, kind: str, **spec: Any) -> dict[str, Any]:
    """A pool on the `kind` nodes (selector and toleration), with `spec` on top."""
    base: dict[str, Any] = {
        "nodeSelector": {"berth.test/gpu": kind},
        "tolerations": [
            {"key": TAINT_KEY, "operator": "Equal", "value": kind, "effect": "NoSchedule"}
        ],
    }
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.POOL_KIND,
        "metadata": {"name": name},
        "spec": {**base, **spec},
    }


@pytest.fixture
def pool_names(installed: ControlPlane) -> Iterator[Any]:
    """Unique pool names for one test; the pools are deleted after it."""
    made: list[str] = []
    suffix = uuid.uuid4().hex[:6]

    def name(base: str) -> str:
        made.append(f"{base}-{suffix}")
        return made[-1]

    yield name
    if made:
        installed.kubectl("delete", "bap", *made, "--ignore-not-found", check=False)


def apply_pools(plane: ControlPlane, *pools: dict[str, Any]) -> None:
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(pools)})
    plane.kubectl("apply", "-f", "-", stdin=body)


def pool_status(plane: ControlPlane, name: str) -> dict[str, Any]:
    result = plane.kubectl("get", "bap", name, "-o", "json", "--ignore-not-found")
    return (json.loads(result.stdout) if result.stdout.strip() else {}).get("status") or {}


def statefulset(plane: ControlPlane, ns: str, name: str) -> dict[str, Any] | None:
    return get(plane, "statefulset", ns, name)


def replicas(plane: ControlPlane, ns: str, name: str) -> int:
    found = statefulset(plane, ns, name)
    return 0 if found is None else int(found["spec"]["replicas"])


def nodes_of(plane: ControlPlane, ns: str, name: str) -> list[str]:
    return sorted(p["spec"].get("nodeName", "") for p in pods(plane, ns, rank_selector(name)))


def reasons(plane: ControlPlane, ns: str, name: str) -> set[str]:
    return {e["reason"] for e in events(plane, ns, name)}


def test_a_pool_reports_its_capacity_and_what_ranks_claim(
    installed: ControlPlane, serving_namespace: str, gpu_nodes: Any, pool_names: Any
) -> None:
    plane, ns = installed, serving_namespace
    h100 = pool_names("h100")
    apply_pools(plane, pool(h100, "h100", limits={"maxAccelerators": 3}))

    def capacity() -> dict[str, Any]:
        found = pool_status(plane, h100)
        assert (found.get("nodes"), found.get("allocatable"), found.get("claimed")) == (2, 4, 0)
        return found

    found = eventually(capacity, what="the pool's capacity")
    assert condition({"status": found}, "NodesAvailable")["status"] == "True"
    apply(plane, ns, isvc("chat", {"pools": [{"name": h100}], "replicas": 2}))
    body = wait_ready(plane, ns, "chat")
    assert body["status"]["pools"] == [{"pool": h100, "ranks": 2}]
    assert set(nodes_of(plane, ns, "chat")) <= {"bt-h100-0", "bt-h100-1"}
    for pod in pods(plane, ns, rank_selector("chat")):
        assert pod["spec"]["containers"][0]["resources"]["limits"][GPU] == "1"

    def claimed() -> dict[str, Any]:
        found = pool_status(plane, h100)
        assert found.get("claimed") == 2
        assert found["services"] == [f"{ns}/chat"]
        assert found["namespaces"] == [{"namespace": ns, "claimed": 2}]
        return found

    eventually(claimed, what="the claim in the pool's status")
    # The nodes go away (cordoned): the claims stay, over what the pool now has.
    plane.kubectl("cordon", "bt-h100-0", "bt-h100-1")
    try:

        def over() -> dict[str, Any]:
            found = pool_status(plane, h100)
            nodes = condition({"status": found}, "NodesAvailable")
            over = condition({"status": found}, "OverCommitted")
            assert (found["nodes"], found["allocatable"], nodes["reason"]) == (
                0,
                0,
                "NoMatchingNodes",
            )
            assert (over["status"], over["reason"]) == ("True", "OverAllocatable")
            return found

        eventually(over, what="the pool to be over-committed")
    finally:
        plane.kubectl("uncordon", "bt-h100-0", "bt-h100-1")
    eventually(lambda: pool_status(plane, h100).get("nodes") == 2, what="the nodes back")
    table = plane.kubectl("get", "bap", h100).stdout
    header, row = table.splitlines()[:2]
    assert header.split() == [
        "NAME",
        "RESOURCE",
        "PER-RANK",
        "NODES",
        "ALLOCATABLE",
        "CLAIMED",
        "MAX",
        "AGE",
    ]
    assert row.split()[:7] == [h100, GPU, "1", "2", "4", "2", "3"]


def small_h100_and_l4(plane: ControlPlane, pool_names: Any) -> tuple[str, str]:
    """Two pools: h100 limited to 2 GPUs (two ranks of one), l4 with 2 GPUs per rank."""
    h100, l4 = pool_names("h100"), pool_names("l4")
    apply_pools(
        plane,
        pool(h100, "h100", limits={"maxAccelerators": 2}),
        pool(l4, "l4", accelerator={"resource": GPU, "perRank": 2}),
    )
    return h100, l4


def test_ranks_go_to_the_first_pool_with_room_and_else_to_the_next(
    installed: ControlPlane, serving_namespace: str, gpu_nodes: Any, pool_names: Any
) -> None:
    plane, ns = installed, serving_namespace
    h100, l4 = small_h100_and_l4(plane, pool_names)
    pools = [{"name": h100}, {"name": l4}]
    apply(plane, ns, isvc("first", {"pools": pools, "replicas": 2}))
    assert wait_ready(plane, ns, "first")["status"]["pools"] == [{"pool": h100, "ranks": 2}]
    apply(plane, ns, isvc("second", {"pools": pools, "replicas": 2}))
    assert wait_ready(plane, ns, "second")["status"]["pools"] == [{"pool": l4, "ranks": 2}]
    assert nodes_of(plane, ns, "second") == ["bt-l4-0", "bt-l4-0"]
    limits = pods(plane, ns, rank_selector("second"))[0]["spec"]["containers"][0]["resources"]
    assert limits["limits"][GPU] == "2"


def test_ranks_the_first_pool_has_no_room_for_run_in_the_next_as_the_next_ranks(
    installed: ControlPlane, serving_namespace: str, gpu_nodes: Any, pool_names: Any
) -> None:
    plane, ns = installed, serving_namespace
    h100, l4 = small_h100_and_l4(plane, pool_names)
    apply(plane, ns, isvc("spread", {"pools": [{"name": h100}, {"name": l4}], "replicas": 3}))
    body = wait_ready(plane, ns, "spread")
    assert body["status"]["pools"] == [{"pool": h100, "ranks": 2}, {"pool": l4, "ranks": 1}]
    assert body["status"]["readyRanks"] == "3/3"
    by_rank = {
        int(p["metadata"]["labels"][c.POD_INDEX_LABEL]): p
        for p in pods(plane, ns, rank_selector("spread"))
    }
    assert sorted(by_rank) == [0, 1, 2]
    assert by_rank[2]["metadata"]["name"] == "spread-s1-2"
    assert by_rank[2]["spec"]["nodeName"] == "bt-l4-0"
    assert by_rank[2]["spec"]["containers"][0]["resources"]["limits"][GPU] == "2"
    assert {by_rank[0]["spec"]["nodeName"], by_rank[1]["spec"]["nodeName"]} <= {
        "bt-h100-0",
        "bt-h100-1",
    }
    # Rank 2's Service selects exactly its pod, in the second rank set.
    service = get(plane, "service", ns, "spread-rank-2")
    assert service is not None
    selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
    assert [p["metadata"]["name"] for p in pods(plane, ns, selector)] == ["spread-s1-2"]

    def claimed(pool_name: str, amount: int) -> bool:
        return pool_status(plane, pool_name).get("claimed") == amount

    eventually(lambda: claimed(h100, 2) and claimed(l4, 2), what="both pools' claims")
    # Scaled down, the highest rank goes first: the second rank set, and its StatefulSet.
    plane.kubectl("scale", "-n", ns, "bis/spread", "--replicas=2")
    eventually(lambda: statefulset(plane, ns, "spread-s1") is None, what="the second set pruned")
    # (Ready stays True throughout: wait for the status that reports the scale-down.)
    eventually(
        lambda: (
            (get(plane, "bis", ns, "spread") or {})["status"]["pools"]
            == [{"pool": h100, "ranks": 2}]
        ),
        what="the status to show one pool",
    )
    assert condition(wait_ready(plane, ns, "spread"), "Ready")["reason"] == "Ready"
    eventually(lambda: claimed(l4, 0), what="the l4 claim released")


def test_limits_hold_for_services_scaling_up_at_once_and_freed_room_goes_to_the_waiting(
    installed: ControlPlane, serving_namespace: str, gpu_nodes: Any, pool_names: Any
) -> None:
    plane, ns = installed, serving_namespace
    other = f"{ns}-b"
    plane.kubectl("create", "namespace", other)
    plane.kubectl("label", "namespace", other, "berth.test/team=web")
    try:
        h100 = pool_names("h100")
        limits = {
            "maxAccelerators": 4,
            "namespaces": [{"matchLabels": {"berth.test/team": "web"}, "maxAccelerators": 1}],
        }
        apply_pools(plane, pool(h100, "h100", limits=limits))
        spec = {"pools": [{"name": h100}], "replicas": 1}
        apply(plane, ns, isvc("alpha", spec), isvc("beta", spec))
        apply(plane, other, isvc("gamma", spec))
        for where, name in ((ns, "alpha"), (ns, "beta"), (other, "gamma")):
            wait_ready(plane, where, name)

        # gamma's namespace may have one accelerator: it stays at one rank and says why.
        plane.kubectl("scale", "-n", other, "bis/gamma", "--replicas=3")
        gamma = wait_condition(plane, other, "gamma", "Ready", reason="QuotaExceeded")
        message = condition(gamma, "Ready")["message"]
        assert f"pool {h100}: limits.namespaces[0].maxAccelerators is 1 for namespace" in message
        assert replicas(plane, other, "gamma") == 1

        # alpha and beta scale up together; sample the StatefulSets all along.
        services = ((ns, "alpha"), (ns, "beta"), (other, "gamma"))
        highest: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                highest.append(sum(replicas(plane, w, n) for w, n in services))

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            plane.kubectl("scale", "-n", ns, "bis/alpha", "bis/beta", "--replicas=3")
            eventually(
                lambda: replicas(plane, ns, "alpha") + replicas(plane, ns, "beta") == 3,
                what="alpha and beta to take the room left",
            )
            time.sleep(3)
        finally:
            stop.set()
            sampler.join()
        assert max(highest) <= 4, highest
        assert replicas(plane, other, "gamma") == 1
        assert replicas(plane, ns, "alpha") + replicas(plane, ns, "beta") == 3
        first, waiting = (
            ("alpha", "beta") if replicas(plane, ns, "alpha") == 3 else ("beta", "alpha")
        )
        short = wait_condition(plane, ns, waiting, "Ready", reason="QuotaExceeded")
        assert f"pool {h100}: limits.maxAccelerators is 4" in condition(short, "Ready")["message"]
        assert condition(short, "Ready")["status"] == "True"  # fewer ranks, serving
        assert short["status"]["desiredReplicas"] == 3
        assert "QuotaExceeded" in reasons(plane, ns, waiting)

        # alpha gives up two ranks: the room goes to beta (waiting longest), never to gamma.
        first, waiting = (
            ("alpha", "beta") if replicas(plane, ns, "alpha") == 3 else ("beta", "alpha")
        )
        plane.kubectl("scale", "-n", ns, f"bis/{first}", "--replicas=1")
        # 4 in the pool: gamma 1, the one that gave up 1, the waiting one all the rest.
        eventually(lambda: replicas(plane, ns, waiting) == 2, what=f"{waiting} to grow")
        time.sleep(3)
        assert replicas(plane, other, "gamma") == 1
        assert replicas(plane, ns, waiting) == 2
    finally:
        plane.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_pool_defaults_fill_the_spec_and_a_locked_field_is_refused(
    installed: ControlPlane, serving_namespace: str, gpu_nodes: Any, pool_names: Any
) -> None:
    plane, ns = installed, serving_namespace
    h100 = pool_names("h100")
    defaults = {
        "image": "registry.local/berth-runtime:cuda",
        "args": {"dtype": "bfloat16", "contextLength": 8192},
        "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        "sharedMemory": "2Gi",
    }
    apply_pools(plane, pool(h100, "h100", defaults=defaults, locked=["image"]))
    apply(
        plane,
        ns,
        isvc(
            "tuned",
            {
                "pools": [{"name": h100, "args": {"maxRunningRequests": 64}}],
                "runtime": {"args": {"contextLength": 2048}},
            },
        ),
    )
    wait_ready(plane, ns, "tuned")
    found = statefulset(plane, ns, "tuned")
    assert found is not None
    container = found["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == defaults["image"]
    args = container["args"]
    assert args[args.index("--dtype") + 1] == "bfloat16"
    assert args[args.index("--context-length") + 1] == "2048"  # the service's own wins
    assert args[args.index("--max-running-requests") + 1] == "64"  # the per-pool override
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in container["env"]
    volumes = found["spec"]["template"]["spec"]["volumes"]
    assert {"medium": "Memory", "sizeLimit": "2Gi"} in [v.get("emptyDir") for v in volumes]

    apply(plane, ns, isvc("mine", {"pools": [{"name": h100}], "runtime": {"image": "mine:1"}}))
    refused = wait_condition(plane, ns, "mine", "Ready", reason="PoolConflict")
    assert (
        "image is locked to 'registry.local/berth-runtime:cuda'"
        in condition(refused, "Ready")["message"]
    )
    assert condition(refused, "Stalled")["status"] == "True"
    assert "PoolConflict" in reasons(plane, ns, "mine")
    assert statefulset(plane, ns, "mine") is None
    stored = (get(plane, "bis", ns, "mine") or {})["spec"]["runtime"]  # nothing written to it
    assert stored["image"] == "mine:1" and "dtype" not in (stored.get("args") or {})


def test_invalid_pool_references_create_nothing_until_the_pool_exists(
    installed: ControlPlane, serving_namespace: str, gpu_nodes: Any, pool_names: Any
) -> None:
    plane, ns = installed, serving_namespace
    later, closed, small = pool_names("later"), pool_names("closed"), pool_names("small")
    apply_pools(
        plane,
        pool(closed, "h100", limits={"allowedNamespaces": {"names": ["somewhere-else"]}}),
        pool(small, "h100"),
    )
    cases = {
        "unknown": (
            {"pools": [{"name": later}]},
            "PoolNotFound",
            f"pool {later}: no AcceleratorPool",
        ),
        "closed": (
            {"pools": [{"name": closed}]},
            "PoolNotAllowed",
            f"namespace {ns} may not use it",
        ),
        "huge": (
            {"pools": [{"name": small, "acceleratorsPerRank": 3}]},
            "PoolTooSmall",
            "a rank needs 3 nvidia.com/gpu, and its largest node has 2",
        ),
    }
    for name, (spec, _, _) in cases.items():
        apply(plane, ns, isvc(name, spec))
    for name, (_, reason, text) in cases.items():
        body = wait_condition(plane, ns, name, "Ready", reason=reason)
        assert text in condition(body, "Ready")["message"]
        assert reason in reasons(plane, ns, name)
        assert statefulset(plane, ns, name) is None
        assert pods(plane, ns, rank_selector(name)) == []
    apply_pools(plane, pool(later, "h100"))
    assert wait_ready(plane, ns, "unknown")["status"]["pools"] == [{"pool": later, "ranks": 1}]


def test_a_lowered_limit_stops_no_rank_and_adds_none(
    installed: ControlPlane, serving_namespace: str, gpu_nodes: Any, pool_names: Any
) -> None:
    plane, ns = installed, serving_namespace
    h100 = pool_names("h100")
    apply_pools(plane, pool(h100, "h100", limits={"maxAccelerators": 4}))
    apply(plane, ns, isvc("steady", {"pools": [{"name": h100}], "replicas": 2}))
    wait_ready(plane, ns, "steady")
    before = sorted(p["metadata"]["uid"] for p in pods(plane, ns, rank_selector("steady")))
    plane.kubectl(
        "patch",
        "bap",
        h100,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"limits": {"maxAccelerators": 1}}}),
    )

    def over() -> dict[str, Any]:
        cond = condition({"status": pool_status(plane, h100)}, "OverCommitted")
        assert (cond.get("status"), cond.get("reason")) == ("True", "OverLimit")
        return cond

    eventually(over, what="the pool to say it is over its limit")
    plane.kubectl("scale", "-n", ns, "bis/steady", "--replicas=3")
    body = wait_condition(plane, ns, "steady", "Ready", reason="QuotaExceeded")
    assert condition(body, "Ready")["status"] == "True"
    time.sleep(3)
    assert replicas(plane, ns, "steady") == 2
    after = sorted(p["metadata"]["uid"] for p in pods(plane, ns, rank_selector("steady")))
    assert after == before  # no rank was stopped


def test_the_sample_pools_install_and_report_the_default_gpu_node(
    installed: ControlPlane, berth_operator: Any
) -> None:
    plane = installed
    samples = REPO_ROOT / "manifests" / "samples" / "pools"
    plane.kubectl("apply", "-k", str(samples))
    try:

        def reported() -> dict[str, Any]:
            gpu = pool_status(plane, "gpu")
            assert (gpu.get("nodes"), gpu.get("allocatable")) == (1, 8)  # kwok-gpu-0
            assert (
                condition({"status": pool_status(plane, "mig-3g-40gb")}, "NodesAvailable")["reason"]
                == "NoMatchingNodes"
            )
            return gpu

        eventually(reported, what="the sample pools' status")
    finally:
        plane.kubectl("delete", "-k", str(samples), "--wait=false", check=False)


def test_a_tensor_parallel_rank_claims_a_gpu_per_process_on_one_node(
    installed: ControlPlane, serving_namespace: str, gpu_nodes: Any, pool_names: Any
) -> None:
    """parallelism.tensor 2 in a pool of one GPU per rank: each rank asks for 2 GPUs and runs
    `--tp-size 2` on a node with 2 free (one H100 node each); the pool counts 2 per rank."""
    plane, ns = installed, serving_namespace
    h100 = pool_names("h100")
    apply_pools(plane, pool(h100, "h100"))
    spec = {"pools": [{"name": h100}], "replicas": 2, "parallelism": {"tensor": 2}}
    apply(plane, ns, isvc("split", spec))
    body = wait_ready(plane, ns, "split")
    assert body["status"]["pools"] == [{"pool": h100, "ranks": 2}]
    assert nodes_of(plane, ns, "split") == ["bt-h100-0", "bt-h100-1"]
    for pod in pods(plane, ns, rank_selector("split")):
        (runtime,) = pod["spec"]["containers"]
        assert runtime["resources"]["limits"][GPU] == "2"
        at = runtime["args"].index("--tp-size")
        assert runtime["args"][at + 1] == "2"
    eventually(lambda: pool_status(plane, h100).get("claimed") == 4, what="the pool's claim")
