"""The scheduler process: load the model, then loop receiving requests and running steps."""

from __future__ import annotations

import logging
import os
import time
from multiprocessing.connection import Connection

import torch
import zmq

from berth_common.logging import configure_logging
from berth_common.malloc import release_free_memory
from berth_runtime.constrained.grammar import GrammarCompiler
from berth_runtime.io_struct import (
    AbortReq,
    FlushCacheReq,
    LoadLoraAdapterReq,
    TokenizedGenerateReqInput,
    ToScheduler,
    UnloadLoraAdapterReq,
)
from berth_runtime.kernels import cpu as cpu_kernels
from berth_runtime.managers.engine_liveness import StepClock, report_long_steps
from berth_runtime.managers.scheduler import Scheduler
from berth_runtime.model_executor import tensor_parallel
from berth_runtime.model_executor.model_runner import LoadProgress, ModelRunner
from berth_runtime.model_executor.tp_worker import start_workers
from berth_runtime.models.model_files import ModelFiles, read_model_files
from berth_runtime.server_args import ServerArgs
from berth_runtime.utils.zmq_ipc import PortArgs, Receiver, Sender

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
IDLE_POLL_MS = 100
GRAMMAR_POLL_MS = 2  # while the only work is a grammar compiling on its thread
LOG_INTERVAL_S = 10.0


def run_scheduler_process(
    args: ServerArgs,
    ports: PortArgs,
    model_path: str,
    ready: Connection,
    parent_pid: int,
    files: ModelFiles | None = None,
) -> None:
    """The scheduler's life after `init_child_process` (`spawn_targets.run_scheduler`): load, warm
    up, serve. `files`: the model's config and tokenizer if read already (before torch was
    imported); read here otherwise, failures reported to the launcher as any other."""
    configure_logging(args.log_level, "scheduler")

    def report(progress: LoadProgress) -> None:
        ready.send({"status": "loading", "phase": "loading weights", **progress.to_json()})

    try:
        files = files or read_model_files(model_path)
        tokenizer = files.tokenizer
        progress = LoadProgress(report=report)
        tp = None
        if args.tp_size > 1:  # processes 1..N-1 load their shares meanwhile
            start_workers(args, model_path)
            tp = tensor_parallel.current()
        runner = ModelRunner(model_path, args, progress, config=files.config, tp=tp)
        grammar = None
        if args.grammar_backend == "xgrammar":
            grammar = GrammarCompiler.for_model(model_path, runner.vocab_size, files.eos_token_ids)
        scheduler = Scheduler(
            args,
            runner,
            eos_token_ids=files.eos_token_ids,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            grammar=grammar,
        )
        ready.send({"status": "loading", "phase": "warming up", **progress.to_json()})
        warmup(scheduler)
        release_free_memory()  # the bf16 copies the 4-bit weights replaced, loading's buffers
    except Exception as e:
        logger.exception("Scheduler failed to start")
        ready.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    ready.send(
        {
            "status": "ready",
            "architecture": runner.architecture,
            "tp_size": runner.tp.size,
            "context_len": runner.context_len,
            "max_total_num_tokens": runner.kv_pool.size,
            "vocab_size": runner.vocab_size,
            "device": str(runner.device),
            "dtype": str(runner.dtype).removeprefix("torch."),
            "load_time_s": runner.load_time_s,
            "weight_bytes": runner.weight_bytes,
            "q4_weight_bytes": runner.q4_bytes,
            "attention_backend": runner.attention_backend,
            # How MoE layers run their experts: "fused" (one Triton kernel), "grouped" (each
            # expert once over its tokens), null for dense models.
            "moe_experts": runner.moe_experts,
            # The library of Berth's CPU kernels loaded (prebuilt, or built into the cache); null
            # where they are not (a GPU, or a CPU that fell back: see the log's warning).
            "cpu_kernels": str(path) if (path := cpu_kernels.loaded_library()) else None,
            # Decode steps of at most this many sequences replay a CUDA graph (0: none do).
            "cuda_graph_max_bs": runner.graph_runner.max_bs if runner.graph_runner else 0,
            "cuda_graph_capture_s": (
                runner.graph_runner.capture_time_s if runner.graph_runner else 0.0
            ),
            # Plain greedy decode steps launch before the previous one is read back.
            "overlap_schedule": scheduler.overlap and runner.graph_runner is not None,
            "deterministic_inference": runner.deterministic,
            "speculative_algorithm": args.speculative_algorithm,
            # Decode steps of at most this many sequences run on the 4-bit weights (0: none do).
            "gguf_q4_max_batch": runner.gguf_q4_max_batch if runner.q4_bytes else 0,
            # The CPU kernel those steps use: berth_int8 (int8 activations on integer dot
            # products, as llama.cpp) or torch_int4; null without 4-bit weights.
            "q4_kernel": runner.q4_kernel if runner.q4_bytes else None,
            # The instruction set Berth's int8 kernel runs on here (avx2, avx512bw,
            # avx512_vnni: the best the CPU has, under any $BERTH_CPU_ISA cap); null without it.
            "quant_isa": runner.quant_isa,
            # The SIMD level PyTorch dispatches to, which Berth's other CPU kernels are built for.
            "cpu_capability": runner.cpu_capability,
            # Small steps' lm_head on an 8-bit copy (leading scores recomputed exactly).
            "int8_lm_head": runner.int8_lm_head_bytes > 0,
            "kv_bytes_per_token": runner.kv_pool.bytes_per_token,
            "max_running_requests": scheduler.max_running,
            # LoRA: adapters one batch may mix (0: LoRA is off), the highest rank accepted, and
            # those loaded at start.
            "max_loras_per_batch": runner.lora.max_per_batch if runner.lora else 0,
            "max_lora_rank": runner.lora.max_rank if runner.lora else 0,
            "lora_adapters": runner.lora.paths() if runner.lora else {},
        }
    )
    ready.close()
    event_loop(scheduler, ports, parent_pid)


def warmup(scheduler: Scheduler) -> None:
    """One real prefill + decode, so the first user request does not pay for lazy initialisation."""
    from berth_runtime.sampling_params import SamplingParams

    msg = TokenizedGenerateReqInput(
        rid="__warmup__",
        input_ids=[1, 2, 3, 4],
        sampling_params=SamplingParams(max_new_tokens=2, ignore_eos=True),
    )
    scheduler.handle_generate(msg)
    while not scheduler.is_idle:
        scheduler.step()
    stats = scheduler.outputs.stats
    stats.generated_tokens = stats.window_tokens = stats.prompt_tokens = stats.step_count = 0
    stats.spec_draft_tokens = stats.spec_accepted_tokens = 0


def event_loop(scheduler: Scheduler, ports: PortArgs, parent_pid: int) -> None:
    ctx = zmq.Context()
    recv_from_tokenizer = Receiver(ctx, ports.scheduler_input, ToScheduler)
    send_to_detokenizer = Sender(ctx, ports.detokenizer_input)
    send_to_tokenizer = Sender(ctx, ports.tokenizer_input)
    last_heartbeat = 0.0
    was_idle = True
    last_log = time.monotonic()
    clock = StepClock()
    report_long_steps(clock, ctx, ports.tokenizer_input)
    with torch.inference_mode():
        while True:
            timeout = (
                IDLE_POLL_MS
                if scheduler.is_idle
                else GRAMMAR_POLL_MS
                if scheduler.only_compiling
                else 0
            )
            for msg in recv_from_tokenizer.recv_all(timeout):
                if isinstance(msg, TokenizedGenerateReqInput):
                    scheduler.handle_generate(msg)
                elif isinstance(msg, AbortReq):
                    scheduler.handle_abort(msg)
                elif isinstance(msg, FlushCacheReq):
                    send_to_tokenizer.send(scheduler.handle_flush_cache(msg))
                elif isinstance(msg, LoadLoraAdapterReq):
                    scheduler.handle_load_lora(msg)
                elif isinstance(msg, UnloadLoraAdapterReq):
                    scheduler.handle_unload_lora(msg)
            clock.start()
            out = scheduler.step()
            clock.stop()
            if out is not None:
                send_to_detokenizer.send(out)
            scheduler.finish_unloads()
            for reply in scheduler.take_control_replies():
                send_to_tokenizer.send(reply)
            now = time.monotonic()
            idle = scheduler.is_idle
            # Going busy or idle is published at once: a router or an autoscaler reading
            # /get_load just after the last request ended would otherwise see it running for up
            # to a heartbeat, and send the next request elsewhere.
            if now - last_heartbeat >= HEARTBEAT_INTERVAL_S or idle != was_idle:
                last_heartbeat = now
                was_idle = idle
                stats = scheduler.get_stats()
                send_to_detokenizer.send(stats)
                if now - last_log >= LOG_INTERVAL_S and not idle:
                    last_log = now
                    logger.info(
                        "Decode batch. #running-req: %d, #queue-req: %d, token usage: %.2f, "
                        "gen throughput (token/s): %.1f",
                        stats.num_running_reqs,
                        stats.num_waiting_reqs,
                        stats.num_used_tokens / stats.max_total_num_tokens,
                        stats.gen_throughput,
                    )
                if os.getppid() != parent_pid:
                    logger.error("Parent process is gone; exiting")
                    return
