"""`parallelism.tensor`: what a tensor-parallel rank pod asks for and runs."""

from __future__ import annotations

from typing import Any

from berth_operator.builders import rank_pods

from .factories import parse
from .test_builders import parse_server_args


def rank_pod(spec: dict[str, Any]) -> dict[str, Any]:
    return rank_pods.build_rank_statefulset(parse(spec))["spec"]["template"]["spec"]


def container(spec: dict[str, Any]) -> dict[str, Any]:
    (runtime,) = rank_pod(spec)["containers"]
    return runtime


def test_a_tensor_parallel_rank_runs_tp_size_and_asks_for_a_gpu_per_process() -> None:
    runtime = container({"parallelism": {"tensor": 4}})
    assert parse_server_args(runtime["args"]).tp_size == 4
    assert runtime["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert runtime["resources"]["limits"]["nvidia.com/gpu"] == "4"
    shm = next(
        v for v in rank_pod({"parallelism": {"tensor": 4}})["volumes"] if v["name"] == "dshm"
    )
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}  # 1Gi per process


def test_explicit_gpus_and_the_cpu_are_left_as_asked() -> None:
    more = container({"parallelism": {"tensor": 2}, "resources": {"gpus": 4}})
    assert more["resources"]["requests"]["nvidia.com/gpu"] == "4"
    cpu = container({"parallelism": {"tensor": 2}, "runtime": {"args": {"device": "cpu"}}})
    assert "nvidia.com/gpu" not in cpu["resources"]["requests"]
    assert parse_server_args(cpu["args"]).tp_size == 2
    one = container({})
    assert parse_server_args(one["args"]).tp_size == 1 and "--tp-size" not in one["args"]
    shm = next(
        v
        for v in rank_pod({"resources": {"sharedMemory": "512Mi"}, "parallelism": {"tensor": 3}})[
            "volumes"
        ]
        if v["name"] == "dshm"
    )
    assert shm["emptyDir"]["sizeLimit"] == "1536Mi"
