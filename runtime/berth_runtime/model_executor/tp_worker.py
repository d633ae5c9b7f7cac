"""The tensor-parallel worker processes of one rank (`--tp-size N`): the scheduler process is
process 0 and starts the other N - 1, each with its share of the weights and of the KV cache.

Process 0 schedules, as SGLang's TP workers do with their leader: each forward pass and each
lm_head call it makes is first broadcast to the others (`ModelRunner.forward`,
`compute_logits`), which run the same call on their shares; the layers' collectives put the
results together. Only process 0 samples and talks to the other processes of the server.

Faults end the rank, never hang it: a worker that exits makes process 0 exit (code 1) at once
(`watch`), so the server's health goes false, its requests in flight get errors, and the pod
restarts; a worker that hangs holds up process 0's step, which the server's watchdog ends
(`--watchdog-timeout`). A worker dies with process 0 (the parent-death signal).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
from multiprocessing.connection import wait
from typing import Any

import torch

from berth_common.logging import configure_logging
from berth_common.process import STOP_CHILD, die_with_parent, set_process_title
from berth_runtime.model_executor import tensor_parallel
from berth_runtime.model_executor.device import resolve_device
from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Collectives never time out: a worker waits for process 0's next pass however long the rank
# stays idle (gloo's default of 30 minutes would end an idle rank), and process 0 for a worker
# that is still loading its share. Process 0 exiting closes the connections, which a waiting
# worker sees at once; a process that hangs while serving is the watchdog's to end.
COLLECTIVE_TIMEOUT_S = 10 * 365 * 24 * 3600.0


def device_of(args: ServerArgs, rank: int) -> torch.device:
    """Each process's device: GPU `rank` of the pod's GPUs, or the CPU."""
    device = resolve_device(args.device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def share_cpu_threads(size: int) -> None:
    """On the CPU, each of the `size` processes computes with its share of the cores: PyTorch's
    default (every core in each process) would have them fight over the cores, each step
    waiting for the slowest (several times slower on 2 cores). $OMP_NUM_THREADS wins."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))


def start_workers(args: ServerArgs, model_path: str) -> list[mp.process.BaseProcess]:
    """Start processes 1..N-1 and join their process group as process 0 (the caller)."""
    with socket.socket() as probe:  # a free port on loopback for the group's rendezvous
        probe.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    workers = []
    for rank in range(1, args.tp_size):
        worker = ctx.Process(
            target=run_worker,
            args=(args, model_path, rank, init_method),
            name=f"tp-worker-{rank}",
            daemon=True,
        )
        worker.start()
        workers.append(worker)
    device = device_of(args, 0)
    tensor_parallel.init(0, args.tp_size, init_method, device, COLLECTIVE_TIMEOUT_S)
    if device.type == "cpu":
        share_cpu_threads(args.tp_size)
    watch(workers)
    return workers


def watch(workers: list[mp.process.BaseProcess]) -> None:
    """Exit this process (code 1) as soon as any worker exits: the rank cannot serve without
    it, and exiting is what makes the server report it and its pod restart."""

    def run() -> None:
        wait([w.sentinel for w in workers])
        gone = [w for w in workers if not w.is_alive()]
        for worker in gone:
            logger.error(
                "Tensor-parallel %s exited (code %s); the rank cannot serve without it: exiting",
                worker.name,
                worker.exitcode,
            )
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=run, name="tp-watch", daemon=True).start()


def run_worker(args: ServerArgs, model_path: str, rank: int, init_method: str) -> None:
    """Process `rank`: join the group, load its share, then run what process 0 broadcasts."""
    from berth_runtime.model_executor.model_runner import ModelRunner
    from berth_runtime.models.model_files import read_model_files

    set_process_title(f"tp-worker-{rank}")
    die_with_parent()
    # A signal to the process group is for process 0 to act on (drain); STOP_CHILD ends us.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(STOP_CHILD, lambda *_: os._exit(0))
    configure_logging(args.log_level, f"tp-worker-{rank}")
    device = device_of(args, rank)
    group = tensor_parallel.init(rank, args.tp_size, init_method, device, COLLECTIVE_TIMEOUT_S)
    if device.type == "cpu":
        share_cpu_threads(args.tp_size)
    files = read_model_files(model_path)
    runner = ModelRunner(model_path, args, config=files.config, tp=group)
    logger.info("Serving its share of the model (%.0f MB)", runner.weight_bytes / 2**20)
    try:
        serve(runner)
    except RuntimeError as e:  # process 0 went away in the middle of a collective
        logger.info("Stopped: %s", e)
        os._exit(1)
    os._exit(0)


def serve(runner: Any) -> None:
    """Run process 0's broadcast calls until it says stop."""
    with torch.inference_mode():
        while True:
            kind, payload = tensor_parallel.broadcast()
            if kind == "forward":
                runner.model(on_device(payload, runner.device), runner.kv_pool)
            elif kind == "logits":
                runner.model.compute_logits(payload.to(runner.device))
            elif kind == "lora_load":  # process 0 loaded it: so must every process
                runner.lora.load(*payload)
            elif kind == "lora_prepare":
                runner.lora.prepare(*payload)
            elif kind == "lora_drop":
                runner.lora.drop(payload)
            elif kind == "stop":
                return


def for_broadcast(batch: ForwardBatch) -> ForwardBatch:
    """The batch with its tensors on the CPU (broadcast pickles them) and no cached windows."""
    return on_device(batch, torch.device("cpu"))


def on_device(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    changes = {
        f.name: getattr(batch, f.name).to(device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
        and getattr(batch, f.name).device != device
    }
    return dataclasses.replace(batch, **changes, _windows={})
