"""A validating admission webhook that the test steers: the real API server calls it over HTTPS,
so the errors the operator gets back (5xx when the webhook fails, 403 when it denies) are the API
server's own answers.

`answer` decides each call: allow, deny with a message, or fail (HTTP 500). Every call is
recorded, with the time it arrived.
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.cluster import pki
from tests.cluster.controlplane import ControlPlane

ALLOW = "allow"
FAIL = "fail"


@dataclass
class Call:
    time: float
    user: str
    operation: str
    kind: str
    name: str
    dry_run: bool


@dataclass
class Webhook:
    """`answer(call)` returns ALLOW, FAIL or a denial message."""

    answer: Callable[[Call], str] = lambda call: ALLOW
    calls: list[Call] = field(default_factory=list)

    def review(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        request = body["request"]
        call = Call(
            time=time.monotonic(),
            user=request.get("userInfo", {}).get("username", ""),
            operation=request.get("operation", ""),
            kind=request.get("kind", {}).get("kind", ""),
            name=request.get("name", ""),
            dry_run=bool(request.get("dryRun")),
        )
        self.calls.append(call)
        verdict = self.answer(call)
        if verdict == FAIL:
            return 500, {"message": "the webhook is having a bad day"}
        response: dict[str, Any] = {"uid": request["uid"], "allowed": verdict == ALLOW}
        if verdict != ALLOW:
            response["status"] = {"code": 403, "reason": "Forbidden", "message": verdict}
        return 200, {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": response,
        }


@contextmanager
def serving(plane: ControlPlane, namespace: str, webhook: Webhook) -> Iterator[Webhook]:
    """Serve `webhook` on loopback and register it for StatefulSets in `namespace`."""
    assert plane.pki is not None
    directory = plane.pki.ca.cert.parent
    cert = pki.serving_certificate(directory, f"webhook-{namespace}", ("IP:127.0.0.1",))

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802  (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            code, payload = webhook.review(body)
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert.cert), str(cert.key))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    name = f"berth-test-{namespace}"
    config = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "statefulsets.berth-test.example.com",
                "clientConfig": {
                    "url": f"https://127.0.0.1:{server.server_address[1]}/validate",
                    "caBundle": base64.b64encode(plane.pki.ca.cert.read_bytes()).decode(),
                },
                "rules": [
                    {
                        "apiGroups": ["apps"],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["statefulsets"],
                        "scope": "Namespaced",
                    }
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "failurePolicy": "Fail",
                "sideEffects": "None",  # so dry runs are sent to it too
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 5,
            }
        ],
    }
    plane.kubectl("apply", "-f", "-", stdin=json.dumps(config))
    try:
        _wait_registered(plane, namespace, webhook)
        yield webhook
    finally:
        plane.kubectl("delete", "validatingwebhookconfiguration", name, check=False)
        server.shutdown()
        server.server_close()


def _wait_registered(plane: ControlPlane, namespace: str, webhook: Webhook) -> None:
    """The API server picks the configuration up asynchronously: probe until it calls us."""
    probe = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "webhook-probe", "namespace": namespace},
        "spec": {
            "serviceName": "probe",
            "selector": {"matchLabels": {"app": "probe"}},
            "template": {
                "metadata": {"labels": {"app": "probe"}},
                "spec": {"containers": [{"name": "c", "image": "registry.invalid/probe:1"}]},
            },
        },
    }
    answer = webhook.answer
    webhook.answer = lambda call: ALLOW
    try:
        deadline = time.monotonic() + 30
        while not any(call.name == "webhook-probe" for call in webhook.calls):
            assert time.monotonic() < deadline, "the API server never called the webhook"
            plane.kubectl(
                "apply", "--dry-run=server", "-f", "-", stdin=json.dumps(probe), check=False
            )
            time.sleep(0.2)
    finally:
        webhook.answer = answer
        webhook.calls.clear()
