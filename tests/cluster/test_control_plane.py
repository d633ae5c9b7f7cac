"""The control plane fixture is real: admission, controllers, scheduling, tokens, GC, our manifests.

Each test checks one behaviour that an emulator would have to imitate and that the real binaries
provide: PodSecurity admission, the Deployment and ReplicaSet controllers with kube-scheduler and
kwok's fake nodes, the EndpointSlice controller, the TokenRequest API and token authentication,
and the garbage collector.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.cluster.controlplane import DEFAULT_NODES, REPO_ROOT, ControlPlane
from tests.helpers import wait_for

VERSIONS = dict(
    line.split("=", 1)
    for line in (REPO_ROOT / "hack" / "control-plane" / "versions.env").read_text().splitlines()
    if line and not line.startswith("#")
)
TIMEOUT = 60.0


def deployment(name: str, replicas: int = 1) -> dict[str, Any]:
    """A Deployment of an image nobody pulls: kwok runs no container."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "main", "image": "registry.invalid/berth:test"}]},
            },
        },
    }


def apply(plane: ControlPlane, namespace: str, *objects: dict[str, Any]) -> None:
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
    plane.kubectl("apply", "-n", namespace, "-f", "-", stdin=body)


def items(plane: ControlPlane, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    return plane.get(kind, "-n", namespace, "-l", selector)["items"]


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def ready_pod(plane: ControlPlane, namespace: str, app: str) -> dict[str, Any]:
    def one_ready() -> dict[str, Any] | None:
        pods = [p for p in items(plane, "pods", namespace, f"app={app}") if is_ready(p)]
        return pods[0] if pods else None

    return wait_for(one_ready, TIMEOUT, interval=0.5, what=f"a Ready pod of {app}")


def test_api_server_is_ready_and_is_the_pinned_release(control_plane: ControlPlane) -> None:
    assert control_plane.kubectl("get", "--raw", "/readyz").stdout == "ok"
    version = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == VERSIONS["KUBERNETES_VERSION"]
    assert control_plane.server.startswith("https://127.0.0.1:")


def test_pod_security_restricted_rejects_a_privileged_pod(
    control_plane: ControlPlane, namespace: str
) -> None:
    control_plane.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "privileged"},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "registry.invalid/berth:test",
                    "securityContext": {"privileged": True},
                }
            ]
        },
    }
    result = control_plane.kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=json.dumps(pod), check=False
    )
    assert result.returncode != 0
    assert 'pods "privileged" is forbidden: violates PodSecurity "restricted:latest"' in (
        result.stderr
    )
    assert 'privileged (container "main" must not set securityContext.privileged=true)' in (
        result.stderr
    )


def test_deployment_pod_runs_on_a_kwok_node_behind_an_endpointslice(
    control_plane: ControlPlane, namespace: str
) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80}]},
    }
    apply(control_plane, namespace, deployment("web"), service)

    replica_sets = wait_for(
        lambda: items(control_plane, "replicasets", namespace, "app=web"),
        TIMEOUT,
        interval=0.5,
        what="the Deployment's ReplicaSet",
    )
    assert replica_sets[0]["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
    pod = ready_pod(control_plane, namespace, "web")
    assert pod["metadata"]["ownerReferences"][0]["name"] == replica_sets[0]["metadata"]["name"]
    assert pod["spec"]["nodeName"] in {node.name for node in DEFAULT_NODES}
    assert pod["status"]["phase"] == "Running"
    pod_ip = pod["status"]["podIP"]

    def endpoints() -> list[dict[str, Any]]:
        slices = items(control_plane, "endpointslices", namespace, "kubernetes.io/service-name=web")
        return [e for s in slices for e in s.get("endpoints") or []]

    endpoint = wait_for(endpoints, TIMEOUT, interval=0.5, what="the Service's EndpointSlice")[0]
    assert endpoint["addresses"] == [pod_ip]
    assert endpoint["conditions"]["ready"] is True
    assert endpoint["targetRef"]["name"] == pod["metadata"]["name"]


def test_token_request_token_authenticates_as_its_service_account(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    control_plane.kubectl("create", "serviceaccount", "robot", "-n", namespace)
    token = control_plane.kubectl("create", "token", "robot", "-n", namespace).stdout.strip()
    assert token.count(".") == 2  # a JWT, signed with the --service-account-signing-key-file

    kubeconfig = control_plane.write_token_kubeconfig(token, tmp_path / "robot.kubeconfig")
    result = control_plane.kubectl("--kubeconfig", str(kubeconfig), "auth", "whoami", "-o", "json")
    user = json.loads(result.stdout)["status"]["userInfo"]
    assert user["username"] == f"system:serviceaccount:{namespace}:robot"
    assert "system:serviceaccounts" in user["groups"]

    # RBAC applies to it: a fresh ServiceAccount may not list pods.
    denied = control_plane.kubectl(
        "--kubeconfig", str(kubeconfig), "get", "pods", "-n", namespace, check=False
    )
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr


def test_deleting_the_owner_garbage_collects_its_children(
    control_plane: ControlPlane, namespace: str
) -> None:
    apply(control_plane, namespace, deployment("gc", replicas=2))
    wait_for(
        lambda: (
            len([p for p in items(control_plane, "pods", namespace, "app=gc") if is_ready(p)]) == 2
        ),
        TIMEOUT,
        interval=0.5,
        what="two Ready pods",
    )
    assert items(control_plane, "replicasets", namespace, "app=gc")

    control_plane.kubectl("delete", "deployment", "gc", "-n", namespace, "--wait=false")
    wait_for(
        lambda: (
            not items(control_plane, "replicasets", namespace, "app=gc")
            and not items(control_plane, "pods", namespace, "app=gc")
        ),
        TIMEOUT,
        interval=0.5,
        what="the ReplicaSet and its pods to be garbage-collected",
    )


def test_manifests_apply(installed: ControlPlane) -> None:
    """`kubectl apply -k manifests/` installs the CRD (Established, documented for `kubectl
    explain`), the namespace, RBAC and the operator Deployment (the `installed` fixture runs the
    apply and fails on any error)."""
    crd = installed.get("crd", "inferenceservices.serving.berth.dev")
    established = [cd for cd in crd["status"]["conditions"] if cd["type"] == "Established"]
    assert established and established[0]["status"] == "True"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["bis"]

    explained = installed.kubectl("explain", "bis.spec.model").stdout
    assert "FIELD: model <Object>" in explained
    assert "The model to serve and where its weights come from." in explained
    assert "uri\t<string>" in explained
    nested = installed.kubectl(
        "explain", "inferenceservices.spec.scheduling.topologySpreadConstraints"
    )
    assert "topologyKey\t<string> -required-" in nested.stdout

    for kind, name in (
        ("namespace", "berth-system"),
        ("clusterrole", "berth-operator"),
        ("clusterrole", "berth-router"),
        ("clusterrolebinding", "berth-operator"),
    ):
        assert installed.get(kind, name)["metadata"]["name"] == name
    for kind, name in (("serviceaccount", "berth-operator"), ("deployment", "berth-operator")):
        assert installed.get(kind, name, "-n", "berth-system")["metadata"]["name"] == name
    namespace = installed.get("namespace", "berth-system")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
