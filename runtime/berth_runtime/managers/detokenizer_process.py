"""The detokenizer process: each step's outputs in with their tokens, out with their text."""

from __future__ import annotations

import logging
import os
from multiprocessing.connection import Connection

import zmq

from berth_common.logging import configure_logging
from berth_common.malloc import release_free_memory
from berth_common.process import init_child_process
from berth_runtime.io_struct import SchedulerStats, ToDetokenizer
from berth_runtime.managers.detokenizer_manager import IncrementalDetokenizer, detokenize_batch
from berth_runtime.server_args import ServerArgs
from berth_runtime.utils.decoding_tokenizer import load_decoding_tokenizer
from berth_runtime.utils.token_bytes import vocab_bytes
from berth_runtime.utils.torch_free import forbid_torch
from berth_runtime.utils.zmq_ipc import PortArgs, Receiver, Sender

logger = logging.getLogger(__name__)

POLL_MS = 500


def run_detokenizer_process(
    args: ServerArgs, ports: PortArgs, model_path: str, ready: Connection
) -> None:
    forbid_torch()  # a tokenizer is all this process needs
    parent_pid = init_child_process("detokenizer")
    configure_logging(args.log_level, "detokenizer")
    try:
        tokenizer = load_decoding_tokenizer(model_path)
        token_bytes = vocab_bytes(tokenizer)
        release_free_memory()  # what reading the vocabulary left behind
        ctx = zmq.Context()
        recv_from_scheduler = Receiver(ctx, ports.detokenizer_input, ToDetokenizer)
        send_to_tokenizer = Sender(ctx, ports.tokenizer_input)
    except Exception as e:
        logger.exception("Detokenizer failed to start")
        ready.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    ready.send({"status": "ready"})
    ready.close()

    detok = IncrementalDetokenizer(
        lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip), token_bytes
    )
    while True:
        batch = recv_from_scheduler.recv(POLL_MS)
        if batch is None:
            if os.getppid() != parent_pid:
                return
            continue
        if isinstance(batch, SchedulerStats):
            send_to_tokenizer.send(batch)  # the heartbeat passes through: both loops are alive
            continue
        send_to_tokenizer.send(detokenize_batch(detok, batch))
