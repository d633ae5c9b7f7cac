"""launch_server: start the engine processes and the HTTP server, and stop them all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn

from berth_common.http import DrainingServer, uvicorn_config
from berth_common.logging import configure_logging
from berth_common.malloc import release_free_memory
from berth_common.process import DRAIN_REQUEST, set_process_title, stop_processes
from berth_runtime.entrypoints.http_server import ServerState, create_app
from berth_runtime.kernels.cpu import toolchain_problem
from berth_runtime.model_executor.device import (
    berth_cpu_problem,
    berth_cpu_required_by,
    check_device,
    resolved_device_type,
    triton_problem,
)
from berth_runtime.models.loader import ModelSourceError, check_model_dir, resolve_model
from berth_runtime.server_args import BUILTIN_MODEL, ServerArgs
from berth_runtime.utils import cpu_isa
from berth_runtime.utils.torch_free import run_isolated
from berth_runtime.utils.zmq_ipc import PortArgs

logger = logging.getLogger(__name__)

CHILD_POLL_S = 0.5


class Engine:
    """The child processes of one server and how to start, watch and stop them."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ports = PortArgs.create()
        self.procs: list[mp.process.BaseProcess] = []

    def start(
        self, model_path: str, on_progress: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        """Spawn the scheduler and detokenizer; block until both are ready (or raise).

        `on_progress` receives the scheduler's loading reports (phase, tensors and bytes done).
        """
        from berth_runtime.managers.spawn_targets import run_detokenizer_process, run_scheduler

        ctx = mp.get_context("spawn")  # never fork a process that may hold threads or CUDA
        infos = []
        for name, target in (
            ("scheduler", run_scheduler),
            ("detokenizer", run_detokenizer_process),
        ):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=target,
                args=(self.args, self.ports, model_path, writer),
                name=name,
                # A daemonic process may not start processes: the scheduler starts its
                # tensor-parallel workers. It dies with this process either way (its
                # parent-death signal), and `stop` ends it before this process exits.
                daemon=not (name == "scheduler" and self.args.tp_size > 1),
            )
            proc.start()
            writer.close()
            self.procs.append(proc)
            infos.append((proc, reader))
        engine_info: dict[str, Any] = {}
        for proc, reader in infos:
            try:
                info = reader.recv()
                while info.get("status") == "loading":
                    on_progress({k: v for k, v in info.items() if k != "status"})
                    info = reader.recv()
            except EOFError:
                raise RuntimeError(f"the {proc.name} process exited during start-up") from None
            if info.get("status") != "ready":
                raise RuntimeError(f"the {proc.name} failed to start: {info.get('message')}")
            engine_info.update({k: v for k, v in info.items() if k != "status"})
        return engine_info

    def dead_child(self) -> str | None:
        for proc in self.procs:
            if not proc.is_alive():
                return f"the {proc.name} process exited unexpectedly (exit code {proc.exitcode})"
        return None

    def stop(self) -> None:
        stop_processes(self.procs)
        shutil.rmtree(self.ports.ipc_dir, ignore_errors=True)


class BerthServer(DrainingServer):
    """uvicorn with a draining shutdown: on SIGTERM/SIGINT refuse new work (503), let in-flight
    requests finish for the grace period, then exit. A second signal of either kind exits at once.

    A child sent SIGTERM or SIGINT asks for the same drain (DRAIN_REQUEST, see
    `berth_common.process`); those requests never count as the second signal, so a signal to the
    whole process group drains once."""

    # The drain can last the whole grace period: a second SIGTERM too must be able to cut it short.
    force_exit_signals = frozenset({signal.SIGINT, signal.SIGTERM})

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        signal.signal(DRAIN_REQUEST, self._drain_requested)
        try:
            with super().capture_signals():
                yield
        finally:
            # The children may still ask while they are being stopped: nothing is left to drain.
            signal.signal(DRAIN_REQUEST, signal.SIG_IGN)

    def _drain_requested(self, sig: int, frame: Any) -> None:
        # With a signal to the whole group, this request and the process's own SIGTERM arrive
        # together, in either order (Python runs SIGUSR1's handler before SIGTERM's): whichever
        # comes first starts the one drain, and neither counts as a second signal.
        self.begin_drain("A child process was asked to stop")

    def begin_drain(self, cause: str) -> None:
        if self.state.phase == "draining" or self.should_exit:
            return
        if self._loop is None or self.state.phase != "ready":
            self.should_exit = True  # still loading (or failed): nothing to drain
            return
        logger.info("%s: draining", cause)
        self.state.phase = "draining"
        self.state.reason = "shutting down"
        self.state.tokenizer_manager.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        tm = self.state.tokenizer_manager
        deadline = time.monotonic() + self.state.args.graceful_shutdown_timeout
        while tm.rid_to_state and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if tm.rid_to_state:
            logger.warning("Grace period over: aborting %d requests", len(tm.rid_to_state))
            tm.abort_request(abort_all=True)
            await asyncio.sleep(0.5)
        self.should_exit = True

    def fail(self, reason: str) -> None:
        """The engine is gone: fail in-flight requests and exit non-zero."""
        logger.error("%s; shutting down", reason)
        self.state.phase = "dead"
        self.state.reason = reason
        if self.state.tokenizer_manager is not None:
            self.state.tokenizer_manager.mark_engine_dead(reason)
        self.exit_code = 1
        self.should_exit = True


def launch_server(args: ServerArgs) -> int:
    """Run `berth serve` until shut down; return the process exit code."""
    configure_logging(args.log_level, "api")
    set_process_title("api")
    try:
        _precheck_model(args)
        _precheck_device(args)
        _precheck_dtype(args)
        _precheck_attention_backend(args)
    except ValueError as e:  # ModelSourceError included
        print(f"berth serve: error: {e}", file=sys.stderr)
        return 2

    state = ServerState(args=args)
    engine = Engine(args)
    server: BerthServer

    @asynccontextmanager
    async def lifespan(_: Any):
        server._loop = asyncio.get_running_loop()
        starter = asyncio.create_task(_start_engine(state, engine, server))
        watcher = asyncio.create_task(_watch_children(engine, server))
        try:
            yield
        finally:
            starter.cancel()
            watcher.cancel()
            if state.tokenizer_manager is not None:
                await state.tokenizer_manager.close()

    app = create_app(state, lifespan=lifespan)
    # SIGTERM drains first (BerthServer); then uvicorn gives what is left 5 s.
    config = uvicorn_config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        graceful_shutdown_s=5,
        access_log=False,  # RequestIdMiddleware writes the access log, with each request's id
    )
    server = BerthServer(config, state)
    try:
        server.run()
    finally:
        engine.stop()
    if server.exit_code == 0 and not server.started:
        return 1  # e.g. the port was taken
    logger.info("Server stopped (exit code %d)", server.exit_code)
    return server.exit_code


def _precheck_model(args: ServerArgs) -> None:
    """Fail before starting anything if `--model` cannot be what we serve (cheap checks only)."""
    if args.model == BUILTIN_MODEL or args.model.startswith("builtin://"):
        from berth_runtime.models.loader import builtin_gguf_path

        if args.model != BUILTIN_MODEL:
            raise ModelSourceError(
                f"unknown builtin model {args.model!r}; the only one is {BUILTIN_MODEL}"
            )
        builtin_gguf_path()
        return
    from pathlib import Path

    path = Path(args.model.removeprefix("file://")).expanduser()
    if not path.exists():
        raise ModelSourceError(f"model path does not exist: {path}")
    if path.is_dir():
        check_model_dir(path, args.load_format)
    elif path.suffix != ".gguf":
        raise ModelSourceError(f"{path} is a file but not a .gguf file")


def _precheck_device(args: ServerArgs) -> None:
    if args.device == "cuda":  # only then, and in a child: the API process never loads torch
        run_isolated(check_device, args.device)


def _precheck_dtype(args: ServerArgs) -> None:
    """bf16 on a CPU that cannot run it is a one-line error here, not a scheduler crash in
    oneDNN (a CPU question: with --device auto, only when no GPU takes the model)."""
    cpu_isa.isa_cap()  # an unknown $BERTH_CPU_ISA is an error too
    if args.dtype != "bfloat16" or args.device == "cuda":
        return
    problem = cpu_isa.bf16_problem()
    if problem is not None and run_isolated(resolved_device_type, args.device) == "cpu":
        raise ValueError(f"--dtype bfloat16: {problem}")


async def _start_engine(state: ServerState, engine: Engine, server: BerthServer) -> None:
    from berth_runtime.entrypoints.response_store import ResponseStore
    from berth_runtime.entrypoints.serving_chat import OpenAIServingChat
    from berth_runtime.entrypoints.serving_completions import OpenAIServingCompletion
    from berth_runtime.entrypoints.serving_generate import NativeServingGenerate
    from berth_runtime.entrypoints.serving_responses import OpenAIServingResponses
    from berth_runtime.managers.tokenizer_manager import TokenizerManager

    loop = asyncio.get_running_loop()
    try:
        state.reason = "resolving the model (converting a GGUF file the first time)"
        # Converting a GGUF file loads torch and the whole model: in a child, not here.
        resolved = await loop.run_in_executor(
            None,
            run_isolated,
            resolve_model,
            state.args.model,
            state.args.model_cache_dir,
            state.args.load_format,
        )
        state.model_path = resolved.path
        state.reason = "loading weights"

        def on_progress(progress: dict[str, Any]) -> None:
            state.load_progress = progress
            state.reason = progress["phase"]
            logger.info(
                "%s: %d/%d tensors, %.0f/%.0f MB",
                progress["phase"],
                progress["tensors_done"],
                progress["tensors_total"],
                progress["bytes_done"] / 2**20,
                progress["bytes_total"] / 2**20,
            )

        state.engine_info = await loop.run_in_executor(
            None, engine.start, resolved.path, on_progress
        )
        tm = await loop.run_in_executor(
            None,
            TokenizerManager,
            state.args,
            engine.ports,
            resolved.path,
            state.engine_info,
            state.metrics,
        )
    except asyncio.CancelledError:
        raise
    except Exception as e:
        server.fail(f"start-up failed: {e}")
        return
    release_free_memory()  # loading the tokenizer leaves tens of MB free on its thread's heap
    tm.start()
    state.tokenizer_manager = tm
    state.serving_chat = OpenAIServingChat(tm)
    state.serving_completion = OpenAIServingCompletion(tm)
    state.serving_generate = NativeServingGenerate(tm)
    state.serving_responses = OpenAIServingResponses(
        tm, ResponseStore(state.args.max_stored_responses), state.args.dp_rank
    )
    state.ready_time = time.time()
    state.phase = "ready"
    state.reason = ""
    logger.info(
        "Ready: serving %s on http://%s:%d (start-up %.1fs)",
        state.args.model_name,
        state.args.host,
        state.args.port,
        state.ready_time - state.started_time,
    )


async def _watch_children(engine: Engine, server: BerthServer) -> None:
    """Fail fast when a child dies; fail after --watchdog-timeout when the engine loop wedges."""
    state = server.state
    while True:
        await asyncio.sleep(CHILD_POLL_S)
        if state.phase not in ("ready", "draining", "loading"):
            return
        reason = engine.dead_child() if engine.procs else None
        tm = state.tokenizer_manager
        if reason is None and tm is not None:
            limit = state.args.watchdog_timeout
            problem = tm.liveness.problem(time.monotonic(), limit, limit)
            if problem is not None:
                reason = f"watchdog: {problem}"
        if reason is not None:
            server.fail(reason)
            return


def _precheck_attention_backend(args: ServerArgs) -> None:
    """An explicit berth_cpu or triton, or deterministic inference, must be able to run (auto
    falls back instead); cheap checks only, the scheduler builds and loads the kernels."""
    if args.attention_backend == "triton":
        problem = triton_problem(args.device)
        if problem is not None:
            raise ValueError(f"--attention-backend triton {problem}")
        return
    required_by = berth_cpu_required_by(
        args.attention_backend,
        args.enable_deterministic_inference,
        args.speculative_algorithm != "none",
    )
    if required_by is None:
        return
    problem = berth_cpu_problem(args.device, args.dtype)
    if problem is not None:
        raise ValueError(f"{required_by} {problem}")
    problem = toolchain_problem()
    if problem is not None:
        raise ValueError(f"{required_by}: {problem}")
