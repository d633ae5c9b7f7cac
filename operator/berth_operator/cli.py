"""`berth operator run` (the kopf operator) and `berth operator render -f FILE` (children YAML)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterable
from typing import Any, TextIO

import yaml

from berth_operator import builders
from berth_operator import constants as c
from berth_operator.plan import RankPlan
from berth_operator.pool_placement import PlacementError, place_for_render
from berth_operator.spec import SpecError

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "render":
        return render(
            args.files,
            args.runtime_image,
            args.namespace,
            sys.stdout,
            sys.stderr,
            router_image=args.router_image,
            pool_files=args.pool_files,
        )
    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="berth operator",
        description="The Berth Kubernetes operator: InferenceService -> rank workloads.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run_p = sub.add_parser(
        "run", help="Run the operator against the cluster (in-cluster account or kubeconfig)"
    )
    scope = run_p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="Serve InferenceServices in this namespace only (repeatable; globs allowed)",
    )
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="Serve InferenceServices in every namespace (the default)",
    )
    run_p.add_argument(
        "--standalone",
        action="store_true",
        help="Do not coordinate with other operator replicas (kopf peering off)",
    )
    run_p.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help=f"Serve kopf's liveness probe at this URL (e.g. {DEFAULT_LIVENESS})",
    )
    run_p.add_argument(
        "--dev",
        action="store_true",
        help="Local development: standalone, verbose, against the current kubeconfig context",
    )
    run_p.add_argument(
        "--observe-interval",
        type=_positive_float,
        default=c.OBSERVE_INTERVAL_SECONDS,
        metavar="SECONDS",
        help="How often each InferenceService's ranks' /metrics are scraped for status, "
        f"health and autoscaling (default: {c.OBSERVE_INTERVAL_SECONDS:g})",
    )
    run_p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="Serve the operator's own Prometheus metrics at :PORT/metrics (default: off)",
    )
    run_p.add_argument("--verbose", action="store_true", help="Log more")
    run_p.add_argument("--debug", action="store_true", help="Log everything, kopf's internals too")
    _image_arg(run_p)

    render_p = sub.add_parser(
        "render", help="Print the children the operator would apply for InferenceService YAML"
    )
    render_p.add_argument(
        "-f",
        "--filename",
        dest="files",
        action="append",
        required=True,
        metavar="FILE",
        help="InferenceService YAML file ('-' for stdin; repeatable; multi-document files ok; "
        "AcceleratorPools in it are used like --pool's)",
    )
    render_p.add_argument(
        "--pool",
        dest="pool_files",
        action="append",
        default=[],
        metavar="FILE",
        help="AcceleratorPool YAML for services that list spec.pools (repeatable): the children "
        "show the service as placed in the first listed pool its namespace may use",
    )
    render_p.add_argument(
        "-n",
        "--namespace",
        default=None,
        help="Namespace for resources that do not set metadata.namespace (default: default)",
    )
    _image_arg(render_p)
    return parser


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, not {text}")
    return value


def _image_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runtime-image",
        default=c.DEFAULT_RUNTIME_IMAGE,
        metavar="IMAGE",
        help="Runtime image for InferenceServices that do not set spec.runtime.image "
        f"(default: {c.DEFAULT_RUNTIME_IMAGE})",
    )
    parser.add_argument(
        "--router-image",
        default=c.DEFAULT_ROUTER_IMAGE,
        metavar="IMAGE",
        help=f"Image of every router Deployment (default: {c.DEFAULT_ROUTER_IMAGE})",
    )


def render(
    files: Iterable[str],
    default_image: str,
    namespace: str | None,
    out: TextIO,
    err: TextIO,
    *,
    router_image: str = c.DEFAULT_ROUTER_IMAGE,
    pool_files: Iterable[str] = (),
) -> int:
    """Write the children of every InferenceService in `files` as one YAML stream; 1 on errors.

    A service that lists pools is rendered as placed in the first of them its namespace may use,
    with the pool's settings merged in (AcceleratorPools from `pool_files` and from `files`)."""
    children: list[dict[str, Any]] = []
    failed = False
    documents: list[tuple[str, dict[str, Any]]] = []
    for path in [*files, *pool_files]:
        try:
            docs = _load(path)
        except (OSError, yaml.YAMLError) as e:
            err.write(f"error: {path}: {e}\n")
            failed = True
            continue
        documents += [(path, doc) for doc in docs if isinstance(doc, dict)]
    pools = [doc for _, doc in documents if doc.get("kind") == c.POOL_KIND]
    for path, doc in documents:
        if doc.get("kind") == c.POOL_KIND:
            continue
        if doc.get("kind") != c.KIND:
            err.write(f"skipping {doc.get('kind')!s} in {path}: not an {c.KIND}\n")
            continue
        if namespace and not (doc.get("metadata") or {}).get("namespace"):
            doc = {**doc, "metadata": {**(doc.get("metadata") or {}), "namespace": namespace}}
        name = (doc.get("metadata") or {}).get("name", "?")
        try:
            isvc, placement = place_for_render(doc, pools, default_image)
        except SpecError as e:
            err.write(f"error: {path}: {c.KIND} {name}: invalid spec:\n")
            for problem in e.problems:
                err.write(f"  - {problem}\n")
            failed = True
            continue
        except PlacementError as e:
            err.write(f"error: {path}: {c.KIND} {name}: {e.reason}: {e.message}\n")
            failed = True
            continue
        children.extend(
            builders.build_children(
                dataclasses.replace(isvc, router_image=router_image),
                RankPlan(placement.grant.ranks) if placement else None,
                [
                    dataclasses.replace(
                        r, isvc=dataclasses.replace(r.isvc, router_image=router_image)
                    )
                    for r in placement.rank_sets
                ]
                if placement
                else (),
            )
        )
    if children:
        yaml.safe_dump_all(children, out, sort_keys=False, explicit_start=True)
    return 1 if failed else 0


def _load(path: str) -> list[Any]:
    if path == "-":
        return list(yaml.safe_load_all(sys.stdin))
    with open(path, encoding="utf-8") as f:
        return list(yaml.safe_load_all(f))


def run(args: argparse.Namespace) -> int:
    import kopf

    from berth_operator import (
        handlers,  # noqa: F401  (registers the handlers)
        metrics,
    )

    verbose = args.verbose or args.dev
    kopf.configure(verbose=verbose, debug=args.debug)
    settings = kopf.OperatorSettings()
    namespaces = list(args.namespace)
    if namespaces and not any(ch in ns for ns in namespaces for ch in "*?[!"):
        # Exact namespaces need no namespace discovery (and no RBAC on namespaces).
        settings.scanning.disabled = True
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port)
    kopf.run(
        settings=settings,
        standalone=args.standalone or args.dev,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(
            default_image=args.runtime_image,
            router_image=args.router_image,
            observe_interval=args.observe_interval,
        ),
    )
    return 0
