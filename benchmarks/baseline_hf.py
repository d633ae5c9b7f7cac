"""The naive baseline: Hugging Face transformers `generate()` in this process, greedy.

Two ways a user without a serving engine would run N requests: one after another (sequential
single stream), or all at once as one static batch (left padding, every row decoded until the
longest is done). Each decode step is timed with a pass-through logits processor, so TTFT (the
prefill) and inter-token gaps come out in the same `RequestResult` form as the HTTP client's.
Output lengths are forced with `min_new_tokens` = `max_new_tokens` (EOS suppressed), like
`ignore_eos` on a server.
"""

from __future__ import annotations

import resource
import time
from typing import Any

from berth_runtime.bench.metrics import RequestResult, summarize
from berth_runtime.bench.workload import BenchRequest

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class _StepTimer:
    """A logits processor that changes nothing and records when each step's logits exist."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.times.append(time.perf_counter())
        return scores


def process_memory() -> dict[str, float]:
    """This process's RSS now and its peak, in MiB."""
    import psutil

    mib = 1024 * 1024
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"rss_mib": psutil.Process().memory_info().rss / mib, "peak_rss_mib": peak_kib / 1024}


class HFBaseline:
    """One model loaded in one dtype; runs workloads sequentially or as static batches."""

    def __init__(self, model_path: str, dtype: str = "fp32", threads: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.dtype = dtype
        self.model_path = model_path
        torch_dtype = getattr(torch, DTYPES.get(dtype, dtype))
        started = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        self.model.eval()
        self.load_time_s = time.perf_counter() - started
        config = self.model.generation_config
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0

    def _generate(
        self, batch: list[BenchRequest], max_new: int
    ) -> tuple[float, list[float], float]:
        """Greedy generate for `batch` (left padded): start, each step's logits time, end."""
        from transformers import LogitsProcessorList

        torch = self.torch
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):
            ids[row, width - request.prompt_len :] = torch.tensor(request.prompt_ids)
            mask[row, width - request.prompt_len :] = 1
        timer = _StepTimer()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=self.pad_id,
                logits_processor=LogitsProcessorList([timer]),
            )
        end = time.perf_counter()
        generated = out.shape[1] - width
        if generated != max_new or len(timer.times) != max_new:
            raise RuntimeError(f"generate() made {generated} tokens, expected {max_new}")
        return start, timer.times, end

    def warmup(self, batch_size: int, prompt: BenchRequest, new_tokens: int = 4) -> None:
        self._generate([prompt] * batch_size, new_tokens)

    def run(self, requests: list[BenchRequest], batch_size: int = 1) -> dict[str, Any]:
        """All requests in static batches of `batch_size`, one batch after another (1 is
        sequential). Token k of a row counts as ready when step k's logits exist (as if
        streamed); every row of a batch ends when generate() returns."""
        results: list[RequestResult] = []
        t0 = time.perf_counter()
        for at in range(0, len(requests), batch_size):
            batch = requests[at : at + batch_size]
            start, step_times, end = self._generate(batch, max(r.output_len for r in batch))
            for request in batch:
                times = [t - start for t in step_times[: request.output_len]]
                results.append(
                    RequestResult(
                        success=True,
                        prompt_len=request.prompt_len,
                        output_len=request.output_len,
                        output_tokens=request.output_len,
                        start=start - t0,
                        ttft=times[0],
                        latency=end - start,
                        chunk_times=times,
                    )
                )
        duration = time.perf_counter() - t0
        return {
            "backend": self.label(batch_size),
            "model": self.model_path,
            "dtype": self.dtype,
            "batch_size": batch_size,
            "num_prompts": len(requests),
            "threads": self.torch.get_num_threads(),
            "load_time_s": self.load_time_s,
            **summarize(results, duration),
            "process_memory": process_memory(),
            "requests": [r.to_dict() for r in results],
        }

    def label(self, batch_size: int) -> str:
        mode = "sequential" if batch_size == 1 else f"static batch {batch_size}"
        return f"HF generate() {self.dtype} {mode}"
