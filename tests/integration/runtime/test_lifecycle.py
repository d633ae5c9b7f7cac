"""Start-up, model sources, API keys, SIGTERM draining and dying children, on real processes."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from berth_common.cli import berth_command
from tests.helpers import (
    BUILTIN_GGUF,
    RunningServer,
    embedded_gguf_dir,
    embedded_model_dir,
    kill_mid_request,
    live_pids,
    wait_for,
)

MODEL = "smollm2-135m-instruct"


def serve_fails(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        berth_command("serve", *args),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_missing_model_is_a_one_line_error():
    result = serve_fails("--model", "/no/such/model")
    assert result.returncode == 2
    assert result.stderr.strip() == "berth serve: error: model path does not exist: /no/such/model"


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    result = serve_fails("--model", str(tmp_path))
    assert result.returncode == 2
    assert "unsupported architecture ['GPT2LMHeadModel']" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_cuda_is_a_one_line_error():
    result = serve_fails("--device", "cuda")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "berth serve: error: --device cuda was requested but no CUDA device is available"
    )


def test_berth_cpu_backend_without_a_compiler_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("CXX", "/no/such/c++")
    monkeypatch.delenv("BERTH_KERNELS_DIR", raising=False)
    result = serve_fails("--attention-backend", "berth_cpu")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "berth serve: error: --attention-backend berth_cpu: no C++ compiler (/no/such/c++) on "
        "PATH and no prebuilt kernels in $BERTH_KERNELS_DIR"
    )


def test_bf16_on_a_cpu_without_it_is_a_one_line_error(monkeypatch):
    """An AVX2-only CPU (forced here: BERTH_CPU_ISA=avx2) cannot run bf16: refused before anything
    starts, naming the way out, not a scheduler crash inside oneDNN."""
    monkeypatch.setenv("BERTH_CPU_ISA", "avx2")
    result = serve_fails("--dtype", "bfloat16")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "berth serve: error: --dtype bfloat16: this CPU has no bf16 support (AVX-512BW/VL/DQ, "
        "AVX512-BF16, AMX or AVX-NE-CONVERT); use --dtype float32"
    )
    monkeypatch.setenv("BERTH_CPU_ISA", "avx3")
    result = serve_fails()
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "berth serve: error: $BERTH_CPU_ISA='avx3': expected one of avx2 or unset"
    )


def test_bad_flag_value_is_a_usage_error():
    result = serve_fails("--max-running-requests", "0")
    assert result.returncode == 2
    assert "--max-running-requests must be positive" in result.stderr


def ipc_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "berth-ipc-*")))


def ipc_dirs_of(pids: list[int]) -> set[str]:
    """The IPC directories whose sockets these processes hold (other servers may run alongside)."""
    dirs = set()
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="unix"):
            if conn.laddr and "berth-ipc-" in conn.laddr:
                dirs.add(os.path.dirname(conn.laddr))
    return dirs


def loads_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch_cpu" in maps.read()


def test_only_the_scheduler_loads_torch_even_while_converting_a_gguf(tmp_path: Path):
    """torch costs ~700 MB per process: the API and detokenizer run without it, and the GGUF
    conversion (which needs it) runs in a child that exits."""
    gguf = str(embedded_gguf_dir() / BUILTIN_GGUF)
    srv = RunningServer("--model", gguf, "--model-cache-dir", str(tmp_path)).wait_ready()
    try:
        assert any(tmp_path.glob("*/config.json")), "the GGUF was not converted by this server"
        # (multiprocessing's resource tracker is the third child)
        by_title = {psutil.Process(pid).cmdline()[0]: pid for pid in srv.child_pids()}
        assert {"berth::scheduler", "berth::detokenizer"} <= set(by_title), by_title
        assert not loads_torch(srv.proc.pid)
        assert not loads_torch(by_title["berth::detokenizer"])
        assert loads_torch(by_title["berth::scheduler"])
        # Templating (tools included), detokenizing and a refused grammar, all without torch.
        chat = {
            "model": BUILTIN_GGUF[:-5],
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "look_up", "parameters": {}}}],
        }
        answer = httpx.post(f"{srv.base_url}/v1/chat/completions", json=chat, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
        bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "x"}}}
        bad = {**chat, "tools": None, "response_format": bad_schema}
        refused = httpx.post(f"{srv.base_url}/v1/chat/completions", json=bad, timeout=60)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "response_format"
        assert not loads_torch(srv.proc.pid)
    finally:
        srv.stop()


def test_sigterm_drains_in_flight_requests_then_exits_cleanly():
    before = ipc_dirs()
    # Serve the GGUF file directly: another model source.
    gguf = str(embedded_gguf_dir() / BUILTIN_GGUF)
    srv = RunningServer("--model", gguf, "--graceful-shutdown-timeout", "60").wait_ready()
    children = srv.child_pids()
    ours = ipc_dirs_of([srv.proc.pid, *children]) & (ipc_dirs() - before)
    titles = {" ".join(psutil.Process(pid).cmdline()).split()[0] for pid in children}
    assert {"berth::scheduler", "berth::detokenizer"} <= titles, titles
    assert len(children) >= 2 and len(ours) == 1
    assert httpx.get(f"{srv.base_url}/v1/models").json()["data"][0]["id"] == BUILTIN_GGUF[:-5]

    result: dict = {}
    body = {"text": "Count slowly:", "sampling_params": {"max_new_tokens": 800, "ignore_eos": True}}

    def in_flight() -> None:
        result["r"] = httpx.post(f"{srv.base_url}/generate", json=body, timeout=120)

    t = threading.Thread(target=in_flight)
    t.start()
    wait_for(
        lambda: httpx.get(f"{srv.base_url}/get_load").json().get("num_running_reqs") == 1,
        30,
        what="the request to run",
    )
    srv.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{srv.base_url}/health").status_code == 503, 10, what="draining")
    assert httpx.get(f"{srv.base_url}/health").json()["status"] == "draining"
    refused = httpx.post(f"{srv.base_url}/generate", json=body, timeout=30)
    assert refused.status_code == 503
    assert refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "1"

    t.join(120)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["meta_info"]["completion_tokens"] == 800
    assert srv.proc.wait(60) == 0
    srv.stop()
    wait_for(lambda: not live_pids(children), 10, what=f"children {live_pids(children)} to exit")
    assert not (ours & ipc_dirs()), "IPC sockets left behind"


def test_api_key_protects_everything_but_health(tmp_path: Path):
    admin_key_file = tmp_path / "admin-key"
    admin_key_file.write_text("adm1n\n")  # as a mounted Secret: a trailing newline is no part
    srv = RunningServer(
        "--model",
        embedded_model_dir(),
        "--dp-rank",
        "2",
        "--log-level",
        "debug",
        "--admin-api-key-file",
        str(admin_key_file),
        env={"BERTH_API_KEY": "s3cret"},
    ).wait_ready()
    try:
        base = srv.base_url
        assert httpx.get(f"{base}/health").status_code == 200
        unauthorized = httpx.get(f"{base}/v1/models")
        assert unauthorized.status_code == 401
        assert unauthorized.json()["error"]["message"]
        assert (
            httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code
            == 401
        )
        assert httpx.post(f"{base}/generate", json={"text": "hi"}).status_code == 401
        ok = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        # A Hugging Face directory is served under its directory name.
        assert ok.json()["data"][0]["id"] == Path(embedded_model_dir()).name
        # The rank says who it is, and each finished request gets one debug line.
        assert ok.headers["x-data-parallel-rank"] == "2"
        gen = httpx.post(
            f"{base}/generate",
            json={"text": "hi", "rid": "logged", "sampling_params": {"max_new_tokens": 2}},
            headers={"Authorization": "Bearer s3cret"},
        )
        assert gen.status_code == 200
        wait_for(lambda: "Finished rid=logged" in srv.output(), 5, what="the request's log line")
        line = next(x for x in srv.output().splitlines() if "Finished rid=logged" in x)
        assert "[api]" in line and "completion_tokens=2" in line
        assert httpx.get(f"{base}/metrics").status_code == 200  # open, like /health
        assert httpx.get(f"{base}/get_load").json()["dp_rank"] == 2  # open: the operator reads it

        # The serving key cannot act on the whole server; the admin key can (and serves too).
        user = {"Authorization": "Bearer s3cret"}
        admin = {"Authorization": "Bearer adm1n"}
        for path, body, param in (
            ("/flush_cache", None, None),
            ("/abort_request", {"abort_all": True}, "abort_all"),
        ):
            refused = httpx.post(f"{base}{path}", json=body, headers=user)
            assert refused.status_code == 403, (path, refused.text)
            assert refused.json()["error"]["type"] == "PermissionDeniedError"
            assert refused.json()["error"]["param"] == param
            allowed = httpx.post(f"{base}{path}", json=body, headers=admin)
            assert allowed.status_code == 200 and allowed.json()["success"] is True, allowed.text
        one = httpx.post(f"{base}/abort_request", json={"rid": "not-running"}, headers=user)
        assert one.status_code == 404  # aborting one request by id stays the serving key's right
        assert httpx.get(f"{base}/v1/models", headers=admin).status_code == 200
        info = httpx.get(f"{base}/get_server_info", headers=admin).json()["server_args"]
        assert "admin_api_key" not in info and "api_key" not in info
        assert "adm1n" not in json.dumps(info)
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_dead_child_fails_requests_and_exits_nonzero(victim: str):
    srv = RunningServer("--model", embedded_model_dir()).wait_ready()
    try:
        procs = [psutil.Process(pid) for pid in srv.child_pids()]
        target = next(p for p in procs if victim in " ".join(p.cmdline()) or p.name() == victim)
        kill_mid_request(srv, target)
    finally:
        srv.stop()
