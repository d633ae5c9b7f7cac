"""The engine children's entry points, importable without torch.

`multiprocessing` names a spawned child's target by module and function, so the parent imports
that module. The scheduler's module imports torch and the model code; the API process must not
(see `utils.torch_free`), so its target imports them in the child only.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

from berth_common.process import init_child_process
from berth_runtime.managers.detokenizer_process import run_detokenizer_process
from berth_runtime.server_args import ServerArgs
from berth_runtime.utils.zmq_ipc import PortArgs

__all__ = ["run_detokenizer_process", "run_scheduler"]


def run_scheduler(args: ServerArgs, ports: PortArgs, model_path: str, ready: Connection) -> None:
    """The scheduler process (`managers.scheduler_process`), imported here, in the child, after
    the model's config and tokenizer are read: before torch, transformers loads without its
    model-loading code (about 45 MB; see `utils.torch_free.torch_hidden`)."""
    from berth_runtime.models.model_files import read_model_files

    # First: a signal to the whole group drains the server from the child's first moment on.
    parent_pid = init_child_process("scheduler")
    try:
        files = read_model_files(model_path)
    except Exception:  # read again below, where failures are reported to the launcher
        files = None
    from berth_runtime.managers.scheduler_process import run_scheduler_process

    run_scheduler_process(args, ports, model_path, ready, parent_pid, files)
