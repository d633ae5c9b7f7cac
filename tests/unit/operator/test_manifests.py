"""The install: `kubectl kustomize manifests/` (and crds/, samples/) is valid, complete and safe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from berth_operator import __version__
from berth_operator import constants as c
from berth_operator.cli import build_parser

from .factories import (
    CRD_PATH,
    K8S_VERSIONS,
    MANIFESTS,
    REPO_ROOT,
    cel_failures,
    kustomize,
    validate_against_crd,
    validate_strict,
)


@pytest.fixture(scope="module")
def install() -> list[dict[str, Any]]:
    return kustomize(MANIFESTS)


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("folder", ["manifests", "crds"])
def test_rendered_objects_are_valid_for_kubernetes_in_strict_mode(
    folder: str, version: str
) -> None:
    docs = kustomize(REPO_ROOT / folder)
    assert docs
    for doc in docs:
        validate_strict(doc, version)


def test_samples_render_and_are_valid_inference_services() -> None:
    docs = kustomize(MANIFESTS / "samples")
    assert len(docs) == 2
    for doc in docs:
        assert doc["kind"] == c.KIND
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)  # custom resource
        validate_against_crd(doc)
        assert cel_failures(doc) == []


def test_every_yaml_file_is_part_of_a_kustomization() -> None:
    referenced: set[Path] = set()
    for kfile in [
        *MANIFESTS.rglob("kustomization.yaml"),
        REPO_ROOT / "crds" / "kustomization.yaml",
    ]:
        for entry in yaml.safe_load(kfile.read_text()).get("resources", []):
            target = (kfile.parent / entry).resolve()
            if target.is_file():
                referenced.add(target)
    # manifests/argocd/ is not installed into the cluster: it is Argo CD's configuration.
    files = [
        p.resolve()
        for p in [*MANIFESTS.rglob("*.yaml"), *(REPO_ROOT / "crds").glob("*.yaml")]
        if p.name != "kustomization.yaml" and (MANIFESTS / "argocd") not in p.parents
    ]
    assert sorted(set(files) - referenced) == []


def test_install_contains_namespace_crd_rbac_and_operator(install: list[dict[str, Any]]) -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in install)
    assert kinds == [
        ("ClusterRole", "berth-acceleratorpool-admin"),
        ("ClusterRole", "berth-acceleratorpool-viewer"),
        ("ClusterRole", "berth-inferenceservice-editor"),
        ("ClusterRole", "berth-inferenceservice-viewer"),
        ("ClusterRole", "berth-operator"),
        ("ClusterRole", "berth-router"),
        ("ClusterRoleBinding", "berth-operator"),
        ("CustomResourceDefinition", f"{c.POOL_PLURAL}.{c.GROUP}"),
        ("CustomResourceDefinition", f"{c.PLURAL}.{c.GROUP}"),
        ("Deployment", "berth-operator"),
        ("Namespace", "berth-system"),
        ("ServiceAccount", "berth-operator"),
    ]
    assert find(install, "CustomResourceDefinition", f"{c.PLURAL}.{c.GROUP}") == yaml.safe_load(
        CRD_PATH.read_text()
    )


def test_binding_gives_the_operators_account_its_role(install: list[dict[str, Any]]) -> None:
    binding = find(install, "ClusterRoleBinding", "berth-operator")
    deployment = find(install, "Deployment", "berth-operator")
    account = find(install, "ServiceAccount", "berth-operator")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "berth-operator",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "berth-operator", "namespace": "berth-system"}
    ]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "berth-operator"
    assert account["metadata"]["namespace"] == deployment["metadata"]["namespace"] == "berth-system"


def test_operator_deployment_is_non_root_probed_and_sized(install: list[dict[str, Any]]) -> None:
    deployment = find(install, "Deployment", "berth-operator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two operators at once
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"].keys() == {"cpu", "memory"}
    assert "memory" in container["resources"]["limits"]
    assert container["image"] == f"{c.OPERATOR_IMAGE}"
    assert container["image"].endswith(f":{__version__}")

    # The probes hit the liveness endpoint the command line opens.
    assert container["command"] == ["berth"]
    assert container["args"][:2] == ["operator", "run"]
    args = build_parser().parse_args(container["args"][1:])
    assert args.all_namespaces and args.standalone
    url = args.liveness.removeprefix("http://")
    host_port, path = url.split("/", 1)
    port = int(host_port.split(":")[1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/" + path
        assert ports[get["port"]] == port


def test_operator_namespace_enforces_the_restricted_pod_security_profile(
    install: list[dict[str, Any]],
) -> None:
    namespace = find(install, "Namespace", "berth-system")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_people_get_editor_and_viewer_roles_aggregated_into_the_builtin_ones(
    install: list[dict[str, Any]],
) -> None:
    editor = find(install, "ClusterRole", "berth-inferenceservice-editor")
    viewer = find(install, "ClusterRole", "berth-inferenceservice-viewer")
    assert editor["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert viewer["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {"create", "delete", "patch"} <= set(editor["rules"][0]["verbs"])
    assert {"get", "list", "watch"} == set(viewer["rules"][0]["verbs"])


def test_the_operator_may_bind_the_router_role_and_no_other(
    install: list[dict[str, Any]],
) -> None:
    operator = find(install, "ClusterRole", "berth-operator")
    router = find(install, "ClusterRole", c.ROUTER_CLUSTER_ROLE)
    assert router["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        }
    ]
    binds = [rule for rule in operator["rules"] if "bind" in rule["verbs"]]
    assert binds == [
        {
            "apiGroups": ["rbac.authorization.k8s.io"],
            "resources": ["clusterroles"],
            "verbs": ["bind"],
            "resourceNames": [c.ROUTER_CLUSTER_ROLE],
        }
    ]
    # Nothing else about roles: it cannot make a Role, nor grant what it holds.
    for rule in operator["rules"]:
        assert not {"roles", "clusterroles"} & set(rule["resources"]) or rule in binds
        assert "escalate" not in rule["verbs"] and "*" not in rule["verbs"]
    # It needs no EndpointSlice access of its own any more.
    assert not any("endpointslices" in rule["resources"] for rule in operator["rules"])
