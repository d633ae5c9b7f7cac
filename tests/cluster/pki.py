"""Certificates for the test control plane, made with the openssl command line.

One CA signs the API server's serving certificate and a client certificate per identity (the admin
in `system:masters`, the controller-manager, the scheduler, kwok). A separate EC key pair signs
ServiceAccount tokens. Keys are EC P-256: they take milliseconds to generate. Certificates are
valid for a week; a new set is made for every control plane.
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

# A self-contained openssl configuration, so the system's openssl.cnf plays no part.
_OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
"""
_LEAF = ["basicConstraints = critical, CA:FALSE", "keyUsage = critical, digitalSignature"]
_DAYS = 7

# Client identities: name -> (user, groups). RBAC's bootstrap policy grants the controller-manager
# and scheduler users their permissions; the admin and kwok are in system:masters.
CLIENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "admin": ("berth-test-admin", ("system:masters",)),
    "controller-manager": ("system:kube-controller-manager", ()),
    "scheduler": ("system:kube-scheduler", ()),
    "kwok": ("berth-test-kwok", ("system:masters",)),
}

# Names the API server answers to: loopback, plus the in-cluster names and address (the first of
# the Service range) of the kubernetes Service.
APISERVER_SANS = (
    "IP:127.0.0.1",
    "IP:10.96.0.1",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: KeyPair
    apiserver: KeyPair
    clients: dict[str, KeyPair]  # by the names in CLIENTS
    sa_public_key: Path
    sa_private_key: Path


def _openssl(command: str, directory: Path) -> None:
    """Run `openssl COMMAND` in `directory` (file names in COMMAND are relative to it)."""
    args = ["openssl", *shlex.split(command)]
    result = subprocess.run(args, cwd=directory, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)} failed in {directory}:\n{result.stderr}")


def _new_key(name: str, directory: Path) -> Path:
    _openssl(f"genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out {name}", directory)
    path = directory / name
    path.chmod(0o600)
    return path


def _subject(common_name: str, groups: tuple[str, ...] = ()) -> str:
    return "/CN=" + common_name + "".join(f"/O={group}" for group in groups)


def _issue(name: str, subject: str, extensions: list[str], directory: Path) -> KeyPair:
    """`name`.key and `name`.crt for `subject`, signed by the CA, with these v3 extensions."""
    key = _new_key(f"{name}.key", directory)
    (directory / f"{name}.ext").write_text("[leaf]\n" + "\n".join(extensions) + "\n")
    _openssl(
        f"req -new -config openssl.cnf -key {name}.key -subj {shlex.quote(subject)}"
        f" -out {name}.csr",
        directory,
    )
    _openssl(
        f"x509 -req -in {name}.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days {_DAYS}"
        f" -extfile {name}.ext -extensions leaf -out {name}.crt",
        directory,
    )
    return KeyPair(cert=directory / f"{name}.crt", key=key)


def generate(
    directory: Path,
    extra_sans: tuple[str, ...] = (),
    extra_clients: dict[str, tuple[str, tuple[str, ...]]] | None = None,
) -> Pki:
    """Write a fresh CA, every certificate and the ServiceAccount key pair into `directory`: the
    API server's also for `extra_sans`, client certificates also for `extra_clients` (as
    CLIENTS: name -> (user, groups))."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "openssl.cnf").write_text(_OPENSSL_CNF)

    ca_key = _new_key("ca.key", directory)
    _openssl(
        "req -x509 -new -config openssl.cnf -extensions ca -key ca.key"
        f" -subj /CN=berth-test-ca -days {_DAYS} -out ca.crt",
        directory,
    )
    apiserver = _issue(
        "apiserver",
        _subject("kube-apiserver"),
        [
            *_LEAF,
            "extendedKeyUsage = serverAuth",
            "subjectAltName = " + ",".join((*APISERVER_SANS, *extra_sans)),
        ],
        directory,
    )
    clients = {
        name: _issue(
            name, _subject(user, groups), [*_LEAF, "extendedKeyUsage = clientAuth"], directory
        )
        for name, (user, groups) in {**CLIENTS, **(extra_clients or {})}.items()
    }
    sa_private_key = _new_key("sa.key", directory)
    _openssl("pkey -in sa.key -pubout -out sa.pub", directory)
    return Pki(
        ca=KeyPair(cert=directory / "ca.crt", key=ca_key),
        apiserver=apiserver,
        clients=clients,
        sa_public_key=directory / "sa.pub",
        sa_private_key=sa_private_key,
    )


def serving_certificate(directory: Path, name: str, sans: tuple[str, ...]) -> KeyPair:
    """A server certificate for `sans` (e.g. "IP:127.0.0.1"), signed by the CA in `directory`
    (made by `generate`): for HTTPS servers the API server calls, such as admission webhooks."""
    return _issue(
        name,
        _subject(name),
        [*_LEAF, "extendedKeyUsage = serverAuth", "subjectAltName = " + ",".join(sans)],
        directory,
    )
