"""The operator as installed, against the real API server: children, server-side apply, drift,
ownership, garbage collection, the scale subresource and the router's discovery.

Everything is installed with `kubectl apply -k manifests/`; the operator runs as a process with
its own ServiceAccount's token (conftest.py, running_operator.py); InferenceServices are applied
with kubectl into namespaces that enforce PodSecurity `restricted`. kube-controller-manager,
kube-scheduler and kwok make the StatefulSets, Deployments, pods, EndpointSlices and garbage
collection real; no container runs.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from berth_common.kube import ApiServer, token_reader
from berth_operator import builders, naming
from berth_operator import constants as c
from berth_operator.spec import InferenceService
from berth_router.discovery import EndpointSliceDiscovery, KubeConfig
from berth_router.workers import Endpoint
from tests.cluster.controlplane import REPO_ROOT, ControlPlane
from tests.cluster.helpers import (
    KIND_NAMES,
    apply,
    children,
    condition,
    events,
    eventually,
    get,
    is_ready,
    isvc,
    pods,
    rank_selector,
    status_of,
    wait_condition,
    wait_ready,
)

SAMPLES = REPO_ROOT / "manifests" / "samples"
RESTORE_SECONDS = 10.0  # "within seconds": every deleted or edited child is back this soon


def expected_children(plane: ControlPlane, namespace: str, name: str) -> dict[str, list[str]]:
    """What the builders make of the InferenceService as stored, by kind."""
    body = get(plane, "bis", namespace, name)
    assert body is not None
    built = builders.build_children(InferenceService.from_body(body))
    found: dict[str, list[str]] = {kind: [] for kind in KIND_NAMES.values()}
    for child in built:
        found[KIND_NAMES[child["kind"]]].append(child["metadata"]["name"])
    return {kind: sorted(names) for kind, names in found.items()}


def container_env(sts: dict[str, Any]) -> dict[str, Any]:
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def managers(obj: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    return sorted(
        (m["manager"], m["operation"], m.get("subresource"))
        for m in obj["metadata"].get("managedFields") or []
    )


def test_both_samples_make_every_child_and_the_rank_pods_pass_restricted(
    installed: ControlPlane, serving_namespace: str
) -> None:
    plane, ns = installed, serving_namespace
    for sample in sorted(SAMPLES.glob("serving_*.yaml")):
        plane.kubectl("apply", "-n", ns, "-f", str(sample))
    for name, router_replicas, ranks in (("smollm2", 1, 2), ("llama-8b", 2, 2)):
        body = wait_ready(plane, ns, name)
        assert children(plane, ns, name) == expected_children(plane, ns, name)
        made = children(plane, ns, name)
        assert made["deployment"] == [f"{name}-router"]
        assert made["rolebinding"] == made["serviceaccount"] == [f"{name}-router"]
        assert len(made["service"]) == 2 + ranks  # entry, headless, one per rank
        assert body["status"]["readyRanks"] == f"{ranks}/{ranks}"
        assert body["status"]["routerReadyReplicas"] == router_replicas

        # The rank pods were admitted by PodSecurity `restricted` (the namespace enforces it)
        # and run: created by the StatefulSet controller, scheduled, started by kwok.
        rank_pods = pods(plane, ns, rank_selector(name))
        assert len(rank_pods) == ranks and all(is_ready(p) for p in rank_pods)
        router_pods = pods(plane, ns, f"{c.LABEL_ISVC}={name},{c.LABEL_ROLE}={c.ROLE_ROUTER}")
        assert len(router_pods) == router_replicas and all(is_ready(p) for p in router_pods)
        # No child or pod carries the label Argo CD's tracking reads as ownership.
        selector = f"{c.LABEL_ISVC}={name}"
        everything = plane.get("all,pdb,sa,rolebinding,ingress", "-n", ns, "-l", selector)["items"]
        assert everything and all(
            "app.kubernetes.io/instance" not in item["metadata"].get("labels", {})
            for item in everything
        )
        # The operator wrote nothing on the InferenceService but its status: no kopf
        # annotations, no finalizer, no spec.
        annotations = body["metadata"].get("annotations", {})
        assert set(annotations) == {"kubectl.kubernetes.io/last-applied-configuration"}
        assert "finalizers" not in body["metadata"]
        stored = plane.get("bis", name, "-n", ns, "--show-managed-fields")
        assert managers(stored) == [
            (c.FIELD_MANAGER, "Update", "status"),
            ("kubectl-client-side-apply", "Update", None),
        ]
    gpu_pods = pods(plane, ns, rank_selector("llama-8b"))
    assert {p["spec"]["nodeName"] for p in gpu_pods} == {"kwok-gpu-0"}
    (runtime,) = gpu_pods[0]["spec"]["containers"]
    assert runtime["resources"]["limits"]["nvidia.com/gpu"] == "1"
    failed_creates = [
        e
        for e in plane.get("events", "-n", ns)["items"]
        if e["reason"] in ("FailedCreate", "FailedScheduling")
    ]
    assert failed_creates == []


def test_removed_fields_disappear_and_other_managers_fields_stay(
    installed: ControlPlane, serving_namespace: str
) -> None:
    plane, ns, name = installed, serving_namespace, "ssa"
    spec: dict[str, Any] = {
        "replicas": 2,
        "runtime": {"env": [{"name": "KEEP", "value": "1"}, {"name": "DROP", "value": "2"}]},
        "scheduling": {"tolerations": [{"key": "dedicated", "operator": "Exists"}]},
        "ingress": {
            "host": "ssa.example.com",
            "annotations": {"keep.example.com/a": "1", "drop.example.com/b": "2"},
        },
    }
    apply(plane, ns, isvc(name, spec))
    wait_ready(plane, ns, name)
    # Other managers: a person annotates the StatefulSet; an HPA owns the router's replicas
    # (it scales the Deployment to its minimum through the scale subresource, metrics or not).
    plane.kubectl("annotate", "-n", ns, "statefulset", name, "example.com/owner=team-a")
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": f"{name}-router"},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": f"{name}-router",
            },
            "minReplicas": 2,
            "maxReplicas": 4,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {
                        "name": "cpu",
                        "target": {"type": "Utilization", "averageUtilization": 80},
                    },
                }
            ],
        },
    }
    apply(plane, ns, hpa)
    router = eventually(
        lambda: (
            (d := get(plane, "deployment", ns, f"{name}-router"))
            and d["spec"]["replicas"] == 2
            and d
        ),
        what="the HPA to scale the router to 2",
    )

    spec["runtime"]["env"] = [{"name": "KEEP", "value": "1"}]
    del spec["scheduling"]
    spec["ingress"]["annotations"] = {"keep.example.com/a": "1"}
    apply(plane, ns, isvc(name, spec))
    wait_condition(plane, ns, name, "Ready", status="True")

    def removed() -> bool:
        sts = get(plane, "statefulset", ns, name)
        ingress = get(plane, "ingress", ns, name)
        assert sts and ingress
        assert "DROP" not in container_env(sts) and container_env(sts)["KEEP"] == "1"
        assert "tolerations" not in sts["spec"]["template"]["spec"]
        annotations = ingress["metadata"].get("annotations", {})
        assert "drop.example.com/b" not in annotations
        assert annotations["keep.example.com/a"] == "1"
        return True

    eventually(removed, what="the removed env var, toleration and annotation to disappear")
    sts = get(plane, "statefulset", ns, name)
    assert sts["metadata"]["annotations"]["example.com/owner"] == "team-a"
    router = get(plane, "deployment", ns, f"{name}-router")
    assert router["spec"]["replicas"] == 2  # the HPA's, though routing.routerReplicas is 1
    owners = {
        m["manager"]
        for m in plane.get("deployment", f"{name}-router", "-n", ns, "--show-managed-fields")[
            "metadata"
        ]["managedFields"]
        if "f:replicas" in m.get("fieldsV1", {}).get("f:spec", {})
    }
    assert owners and c.FIELD_MANAGER not in owners

    # The Ingress itself goes when the spec drops it, and so does the router with all it has.
    del spec["ingress"]
    spec["routing"] = {"routerReplicas": 0}
    apply(plane, ns, isvc(name, spec))

    def pruned() -> bool:
        made = children(plane, ns, name)
        assert made["ingress"] == made["deployment"] == made["rolebinding"] == []
        assert made["serviceaccount"] == []
        assert made["poddisruptionbudget"] == [name]
        return True

    eventually(pruned, what="the Ingress and the router's children to be deleted")
    wait_condition(plane, ns, name, "Ready", status="True")
    entry = get(plane, "service", ns, name)
    assert entry["spec"]["selector"][c.LABEL_ROLE] == c.ROLE_RANK  # straight to the ranks
    assert get(plane, "statefulset", ns, name)["metadata"]["annotations"]["example.com/owner"]


def test_deleted_and_edited_children_of_every_kind_are_restored_within_seconds(
    installed: ControlPlane, serving_namespace: str
) -> None:
    plane, ns, name = installed, serving_namespace, "drift"
    apply(plane, ns, isvc(name, {"replicas": 2, "ingress": {"host": "drift.example.com"}}))
    wait_ready(plane, ns, name)
    made = children(plane, ns, name)
    assert sum(len(v) for v in made.values()) == 11
    uids = {
        (kind, child): get(plane, kind, ns, child)["metadata"]["uid"]
        for kind, names in made.items()
        for child in names
    }

    started = time.monotonic()
    for kind, names in made.items():
        plane.kubectl("delete", kind, *names, "-n", ns, "--wait=false")

    def recreated() -> bool:
        for (kind, child), uid in uids.items():
            obj = get(plane, kind, ns, child)
            assert obj is not None, f"{kind} {child} is missing"
            assert obj["metadata"]["uid"] != uid, f"{kind} {child} is the old one"
        return True

    eventually(recreated, RESTORE_SECONDS, "every child to be re-created")
    recreated_after = time.monotonic() - started
    wait_ready(plane, ns, name)

    # Edits of fields the operator owns, by other field managers, one per kind.
    edits = [
        (
            "statefulset",
            name,
            ["set", "image", f"statefulset/{name}", "runtime=registry.invalid/evil:1"],
        ),
        (
            "deployment",
            f"{name}-router",
            ["set", "env", f"deployment/{name}-router", "-c", "router", "HOME=/root"],
        ),
        (
            "service",
            f"{name}-rank-0",
            [
                "patch",
                "service",
                f"{name}-rank-0",
                "--type=merge",
                "-p",
                json.dumps({"spec": {"selector": {c.POD_NAME_LABEL: f"{name}-1"}}}),
            ],
        ),
        (
            "service",
            name,
            [
                "patch",
                "service",
                name,
                "--type=merge",
                "-p",
                json.dumps({"spec": {"selector": {c.LABEL_ROLE: c.ROLE_RANK}}}),
            ],
        ),
        (
            "poddisruptionbudget",
            name,
            ["patch", "pdb", name, "--type=merge", "-p", '{"spec":{"maxUnavailable":5}}'],
        ),
        (
            "ingress",
            name,
            [
                "patch",
                "ingress",
                name,
                "--type=json",
                "-p",
                '[{"op":"replace","path":"/spec/rules/0/host","value":"evil.example.com"}]',
            ],
        ),
        (
            "serviceaccount",
            f"{name}-router",
            [
                "patch",
                "serviceaccount",
                f"{name}-router",
                "--type=merge",
                "-p",
                '{"automountServiceAccountToken":true}',
            ],
        ),
        (
            "rolebinding",
            f"{name}-router",
            [
                "patch",
                "rolebinding",
                f"{name}-router",
                "--type=json",
                "-p",
                '[{"op":"replace","path":"/subjects/0/name","value":"default"}]',
            ],
        ),
        # A label the operator sets, removed: the child drops out of the operator's watch.
        (
            "service",
            f"{name}-rank-1",
            ["label", "service", f"{name}-rank-1", f"{c.LABEL_MANAGED_BY}-"],
        ),
    ]
    body = get(plane, "bis", ns, name)
    wanted = {
        (KIND_NAMES[child["kind"]], child["metadata"]["name"]): child
        for child in builders.build_children(InferenceService.from_body(body))
    }
    started = time.monotonic()
    for _, _, command in edits:
        plane.kubectl(*command, "-n", ns)

    def restored() -> bool:
        for kind, child, _ in edits:
            obj = get(plane, kind, ns, child)
            want = wanted[kind, child]
            assert obj is not None
            for key, value in want["metadata"]["labels"].items():
                assert obj["metadata"]["labels"].get(key) == value, (kind, child, key)
            if kind in ("statefulset", "deployment"):
                got_pod = obj["spec"]["template"]["spec"]
                want_pod = want["spec"]["template"]["spec"]
                (got,) = got_pod["containers"]
                (wanted_container,) = want_pod["containers"]
                assert got["image"] == wanted_container["image"], (kind, got["image"])
                assert [e["name"] for e in got["env"]] == [
                    e["name"] for e in wanted_container["env"]
                ]
                assert {e["name"]: e.get("value") for e in got["env"]} == {
                    e["name"]: e.get("value") for e in wanted_container["env"]
                }
            elif kind in ("service", "poddisruptionbudget"):
                for key, value in want["spec"].items():
                    if key != "ports":
                        assert obj["spec"][key] == value, (kind, child, key, obj["spec"][key])
            elif kind == "ingress":
                assert obj["spec"]["rules"][0]["host"] == "drift.example.com"
            elif kind == "serviceaccount":
                assert obj["automountServiceAccountToken"] is False
            elif kind == "rolebinding":
                assert obj["subjects"] == want["subjects"]
        return True

    eventually(restored, RESTORE_SECONDS, "every edited child to be restored")
    restored_after = time.monotonic() - started
    wait_ready(plane, ns, name)
    reasons = [e["reason"] for e in events(plane, ns, name)]
    assert "Restored" in reasons
    messages = " ".join(e["message"] for e in events(plane, ns, name) if e["reason"] == "Restored")
    assert "kubectl-set" in messages and "took back" in messages and "re-created" in messages
    print(f"re-created in {recreated_after:.1f}s, restored in {restored_after:.1f}s")


def test_objects_it_does_not_own_are_never_adopted_or_overwritten(
    installed: ControlPlane, serving_namespace: str
) -> None:
    plane, ns = installed, serving_namespace
    # A user's own Service, named like the entry Service of an InferenceService to come.
    users = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "labels": {"app": "web"}},
        "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 8080}]},
    }
    apply(plane, ns, users)
    before = get(plane, "service", ns, "web")
    apply(plane, ns, isvc("web", {}))
    body = wait_condition(plane, ns, "web", "Ready", reason="NameConflict")
    ready = condition(body, "Ready")
    assert "Service web (not created by this InferenceService)" in ready["message"]
    assert condition(body, "Stalled")["status"] == "True"
    assert children(plane, ns, "web")["statefulset"] == []  # nothing applied at all
    after = get(plane, "service", ns, "web")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert "ownerReferences" not in after["metadata"]
    assert any(
        e["reason"] == "NameConflict" and e["type"] == "Warning" for e in events(plane, ns, "web")
    )
    # Once the user's Service is gone, the InferenceService comes up (retried now and then).
    plane.kubectl("delete", "service", "web", "-n", ns)
    wait_ready(plane, ns, "web")

    # Two InferenceServices whose children's names meet: `a`'s router PodDisruptionBudget and
    # `a-router`'s rank PodDisruptionBudget are both `a-router`. The first keeps it.
    apply(plane, ns, isvc("a", {}))
    wait_ready(plane, ns, "a")
    pdb = get(plane, "pdb", ns, "a-router")
    apply(plane, ns, isvc("a-router", {}))
    body = wait_condition(plane, ns, "a-router", "Ready", reason="NameConflict")
    assert (
        "PodDisruptionBudget a-router (controlled by InferenceService a)"
        in condition(body, "Ready")["message"]
    )
    time.sleep(3)  # no flip-flop between the two: the PDB stays exactly as `a` left it
    same = get(plane, "pdb", ns, "a-router")
    assert same["metadata"]["resourceVersion"] == pdb["metadata"]["resourceVersion"]
    assert same["metadata"]["ownerReferences"][0]["name"] == "a"
    assert condition(get(plane, "bis", ns, "a"), "Ready")["status"] == "True"

    # Pruning deletes only what `a` controls, not what merely looks like its children.
    lookalike = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "a-extra", "labels": naming.labels("a", c.ROLE_RANK)},
        "spec": {"selector": {"app": "x"}, "ports": [{"name": "http", "port": 80}]},
    }
    apply(plane, ns, lookalike)
    plane.kubectl("scale", "-n", ns, "bis/a", "--replicas=2")
    eventually(lambda: get(plane, "service", ns, "a-rank-1"), what="rank 1's Service")
    plane.kubectl("scale", "-n", ns, "bis/a", "--replicas=1")
    eventually(lambda: get(plane, "service", ns, "a-rank-1") is None, what="rank 1's pruned")
    kept = get(plane, "service", ns, "a-extra")
    assert kept is not None and "ownerReferences" not in kept["metadata"]


def test_deleting_the_inference_service_removes_every_child(
    installed: ControlPlane, serving_namespace: str
) -> None:
    plane, ns, name = installed, serving_namespace, "gone"
    apply(plane, ns, isvc(name, {"replicas": 2, "ingress": {}}))
    wait_ready(plane, ns, name)
    assert sum(len(v) for v in children(plane, ns, name).values()) == 11
    plane.kubectl("delete", "bis", name, "-n", ns, "--wait=false")
    eventually(lambda: get(plane, "bis", ns, name) is None, 10, "the InferenceService to go")

    def all_gone() -> bool:
        left = {k: v for k, v in children(plane, ns, name).items() if v}
        assert left == {}, left
        assert pods(plane, ns, f"{c.LABEL_ISVC}={name}") == []
        return True

    eventually(all_gone, 60, "the garbage collector to remove every child and pod")


def test_kubectl_scale_and_an_hpa_go_through_the_scale_subresource(
    installed: ControlPlane, serving_namespace: str
) -> None:
    plane, ns, name = installed, serving_namespace, "scaled"
    apply(plane, ns, isvc(name, {"replicas": 1}))
    wait_ready(plane, ns, name)
    plane.kubectl("scale", "-n", ns, f"bis/{name}", "--replicas=3")

    def three() -> bool:
        status = status_of(plane, ns, name)
        assert get(plane, "bis", ns, name)["spec"]["replicas"] == 3
        assert get(plane, "statefulset", ns, name)["spec"]["replicas"] == 3
        assert status["readyRanks"] == "3/3" and status["replicas"] == 3
        return True

    eventually(three, what="3 ranks")
    assert children(plane, ns, name)["service"] == sorted(
        [name, f"{name}-ranks", *(f"{name}-rank-{i}" for i in range(3))]
    )
    scale = json.loads(
        plane.kubectl(
            "get", "--raw", f"/apis/{c.API_VERSION}/namespaces/{ns}/{c.PLURAL}/{name}/scale"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == naming.label_selector(
        naming.selector_labels(name, c.ROLE_RANK)
    )

    # An HPA aimed at the InferenceService: accepted, and the HPA controller scales it through
    # the scale subresource (to its minimum, which needs no metrics).
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name},
        "spec": {
            "scaleTargetRef": {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": name},
            "minReplicas": 4,
            "maxReplicas": 5,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {
                        "name": "cpu",
                        "target": {"type": "Utilization", "averageUtilization": 80},
                    },
                }
            ],
        },
    }
    apply(plane, ns, hpa)

    def four() -> bool:
        assert get(plane, "bis", ns, name)["spec"]["replicas"] == 4
        assert status_of(plane, ns, name)["readyRanks"] == "4/4"
        able = condition(get(plane, "hpa", ns, name), "AbleToScale")
        assert able["status"] == "True", able
        return True

    eventually(four, 60, "the HPA to scale the InferenceService to 4 ranks")


def test_the_router_discovers_the_ranks_from_endpoint_slices_with_its_own_token(
    installed: ControlPlane, serving_namespace: str, tmp_path: Path
) -> None:
    plane, ns, name = installed, serving_namespace, "routed"
    # A neighbour in the namespace, with a rank 2 of its own: the API server applies the router's
    # selector (discovery does not filter again), and must leave the neighbour's slices out.
    apply(plane, ns, isvc(name, {"replicas": 2}), isvc("neighbour", {"replicas": 3}))
    wait_ready(plane, ns, name)
    wait_ready(plane, ns, "neighbour")
    deployment = get(plane, "deployment", ns, f"{name}-router")
    pod_spec = deployment["spec"]["template"]["spec"]
    account = pod_spec["serviceAccountName"]
    (container,) = pod_spec["containers"]
    args = container["args"]
    flag = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}
    token = plane.kubectl("create", "token", account, "-n", ns).stdout.strip()
    token_file = tmp_path / "token"
    token_file.write_text(token)

    # The router's own identity may read EndpointSlices here and nothing else.
    kubeconfig = plane.write_token_kubeconfig(token, tmp_path / "router.kubeconfig")
    for verb, resource, where in (
        ("list", "endpointslices.discovery.k8s.io", ns),
        ("watch", "endpointslices.discovery.k8s.io", ns),
        ("list", "pods", ns),
        ("list", "endpointslices.discovery.k8s.io", "default"),
        ("get", "secrets", ns),
    ):
        answer = plane.kubectl(
            "--kubeconfig",
            str(kubeconfig),
            "auth",
            "can-i",
            verb,
            resource,
            "-n",
            where,
            check=False,
        ).stdout.strip()
        assert answer == ("yes" if where == ns and "endpointslices" in resource else "no"), (
            verb,
            resource,
            where,
        )

    seen: list[dict[int, Endpoint]] = []

    async def discover(until: Any) -> dict[int, Endpoint]:
        server = ApiServer(plane.server, str(plane.pki.ca.cert), token=token_reader(token_file))
        kube = KubeConfig(server, flag["--discover-namespace"])
        discovery = EndpointSliceDiscovery(
            kube,
            flag["--discover-selector"],
            flag["--discover-rank-label"],
            flag["--discover-port-name"],
            seen.append,
        )
        task = asyncio.create_task(discovery.run())
        try:
            deadline = time.monotonic() + 30
            while not (seen and until(seen[-1])):
                assert time.monotonic() < deadline, seen[-1:]
                assert not task.done(), task
                await asyncio.sleep(0.1)
            return seen[-1]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await discovery.close()

    def urls() -> dict[int, str]:
        return {
            int(
                p["metadata"]["labels"][c.POD_INDEX_LABEL]
            ): f"http://{p['status']['podIP']}:{c.HTTP_PORT}"
            for p in pods(plane, ns, rank_selector(name))
        }

    endpoints = asyncio.run(discover(lambda e: len(e) == 2 and all(x.ready for x in e.values())))
    assert {rank: e.url for rank, e in endpoints.items()} == urls()

    # A third rank joins through its Service's EndpointSlice; the router's flags do not change.
    plane.kubectl("scale", "-n", ns, f"bis/{name}", "--replicas=3")
    endpoints = asyncio.run(discover(lambda e: len(e) == 3 and all(x.ready for x in e.values())))
    assert {rank: e.url for rank, e in endpoints.items()} == urls()
    assert (
        get(plane, "deployment", ns, f"{name}-router")["spec"]["template"]
        == deployment["spec"]["template"]
    )
