"""The GPU check: Berth's GPU tests, greedy parity with HF transformers, and throughput, in one run.

    make gpu-check                                   # on a machine with an NVIDIA GPU, no network
    python -m benchmarks.gpu_check --quick --device cpu   # the same steps, small, on a CPU (CI)

Three parts, then one table (stdout) and one JSON file (`--out`):

1. **Tests**: `pytest -m gpu` over the test files that hold `gpu`-marked tests. On a GPU none may be
   skipped: a skip there means the check did not run.
2. **Parity**: three chat requests, greedy, up to 48 tokens, sent to a fresh `berth serve` as its
   first requests, against HF transformers' greedy decoding of the same prompt ids on the same
   device, in the same dtype, from the same weight files. In bf16 it also measures how far each
   one's log-probabilities of the answer's tokens lie from fp32's (HF fp32, teacher-forced).
   **Tensor parallelism** (with 2 or more GPUs; skipped with a message on one): the same
   questions on `--tp-size 2` and on one GPU, greedy, and one stream's decode time per token on
   each. In bf16 a split model may round differently, so differing answers are reported, not
   judged; every request must succeed.
3. **Throughput**: the embedded model and a random-weight 1B Llama-shaped model
   (`--load-format dummy`) at 1, 32 and 256 concurrent requests of 128 tokens in and 256 out,
   through Berth's own benchmark client, each server at its defaults for the device.

The exit status is 0 when the tests pass, every parity answer equals HF's and every benchmark
request succeeds. Speed is reported, not judged: the targets live in the README.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.report import _num, _table
from berth_common.server_process import berth_server
from berth_runtime.bench.client import BenchConfig, run_benchmark
from berth_runtime.bench.workload import EMBEDDED_MODEL, chat_ids, random_workload
from berth_runtime.models.dummy_weights import llama_1b_config, write_dummy_model_dir
from berth_runtime.models.loader import resolve_model

REPO = Path(__file__).resolve().parents[1]
# The README's own request first: the one a new user sends.
PARITY_QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about ships.",
)
PARITY_TOKENS = 48
# A few-layer model of the same family, for the CPU smoke run of the dummy-weights path.
TINY_LLAMA = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512}


@dataclass
class CheckConfig:
    """What to run; the defaults are the full check on a GPU (about five minutes on an H200)."""

    device: str = "cuda"
    concurrency: list[int] = field(default_factory=lambda: [1, 32, 256])
    input_len: int = 128
    output_len: int = 256
    waves: int = 2  # requests per scenario: waves x concurrency (the single stream: 3)
    models: list[str] = field(default_factory=lambda: ["embedded", "dummy-1b"])
    tests: bool = True
    parity: bool = True
    tensor_parallel: bool = True
    server_args: list[str] = field(default_factory=list)


def log(message: str) -> None:
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def gpu_test_files() -> list[str]:
    """The test files that hold `gpu`-marked tests (only they are collected: the rest of the
    suite imports packages a GPU image need not have)."""
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in p.read_text()
    )


def run_gpu_tests(device: str) -> dict[str, Any]:
    """`pytest -m gpu`; on CUDA a skipped test fails the check (it did not run)."""
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    # The parity test is part 2 of this check, run there once with its figures kept.
    cmd += ["--deselect", "tests/integration/runtime/test_gpu_parity.py", *files]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {
        word: int(n)
        for n, word in (part.split()[:2] for part in summary.split(" in ")[0].split(", "))
        if n.isdigit()
    }
    passed = proc.returncode == 0 and (device != "cuda" or not counts.get("skipped"))
    if not passed:
        print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n", file=sys.stderr)
    return {
        "files": files,
        "summary": summary,
        "counts": counts,
        "passed": passed,
        "seconds": time.perf_counter() - started,
    }


def hf_greedy(model: Any, ids: list[int], max_tokens: int, eos: set[int]) -> dict[str, Any]:
    """HF's greedy answer to `ids` (argmax with its KV cache, stopping at EOS or `max_tokens`),
    with the log-probability of each chosen token in the model's own dtype."""
    import torch

    device = next(model.parameters()).device
    out: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        result = model(torch.tensor([ids], device=device), use_cache=True)
        while True:
            scores = result.logits[0, -1].float().log_softmax(-1)
            token = int(scores.argmax())
            out.append(token)
            logprobs.append(float(scores[token]))
            if token in eos or len(out) == max_tokens:
                return {"ids": out, "logprobs": logprobs}
            result = model(
                torch.tensor([[token]], device=device),
                past_key_values=result.past_key_values,
                use_cache=True,
            )


def teacher_forced_logprobs(model: Any, ids: list[int], answer: list[int]) -> list[float]:
    """Log-probabilities `model` gives each token of `answer` after `ids`, in one forward pass."""
    import torch

    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(torch.tensor([ids + answer], device=device)).logits[0].float()
    scores = logits[len(ids) - 1 : len(ids) - 1 + len(answer)].log_softmax(-1)
    return [float(scores[i, t]) for i, t in enumerate(answer)]


def berth_answer(base_url: str, question: str, logprobs: bool) -> dict[str, Any]:
    """One greedy chat request through the OpenAI endpoint, as a user sends it."""
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": PARITY_TOKENS,
        "temperature": 0,
        "logprobs": logprobs,
    }
    resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300, trust_env=False)
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    return {"text": choice["message"]["content"], "logprobs": [c["logprob"] for c in content]}


def _max_deviation(values: list[float], reference: list[float]) -> float | None:
    pairs = list(zip(values, reference))
    return max(abs(a - b) for a, b in pairs) if pairs else None


def check_parity(device: str) -> dict[str, Any]:
    """Part 2: Berth's first three answers after start-up against HF's, same device and dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = "bfloat16" if device == "cuda" else "float32"
    model_dir = resolve_model(EMBEDDED_MODEL).path
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = {tokenizer.eos_token_id, *(tokenizer.convert_tokens_to_ids(["<|im_end|>"]))}
    args = ["--device", device, "--dtype", dtype]
    with berth_server("serve", *args, name="gpu-check-parity") as srv:
        srv.wait_ready(timeout=600)
        # Plain requests first, as users send them (on a GPU their tokens come straight from the
        # decode graph's argmax); then again with logprobs, which the sampler computes.
        answers = [berth_answer(srv.base_url, q, logprobs=False) for q in PARITY_QUESTIONS]
        scored = [berth_answer(srv.base_url, q, logprobs=True) for q in PARITY_QUESTIONS]

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    hf.eval()
    reference = None
    if dtype != "float32":
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        reference = reference.to(device).eval()
    rows = []
    for question, answer, with_logprobs in zip(PARITY_QUESTIONS, answers, scored):
        ids = chat_ids(tokenizer, [{"role": "user", "content": question}])
        expected = hf_greedy(hf, ids, PARITY_TOKENS, eos)
        hf_text = tokenizer.decode(expected["ids"], skip_special_tokens=True)
        row: dict[str, Any] = {
            "question": question,
            "berth": answer["text"],
            "hf": hf_text,
            # Asking for logprobs must not change the answer either.
            "equal": answer["text"] == hf_text == with_logprobs["text"],
        }
        if reference is not None:
            fp32 = teacher_forced_logprobs(reference, ids, expected["ids"])
            row["berth_logprob_dev"] = _max_deviation(with_logprobs["logprobs"], fp32)
            row["hf_logprob_dev"] = _max_deviation(expected["logprobs"], fp32)
        rows.append(row)
    return {"dtype": dtype, "max_tokens": PARITY_TOKENS, "prompts": rows}


TP_DECODE_TOKENS = 128


def check_tensor_parallel(device: str) -> dict[str, Any]:
    """Part 2b: the parity questions on two processes against one, and one stream's decode time
    per token at TP 1 and 2. On CUDA it needs 2 GPUs (else skipped, saying so); on the CPU the
    two processes share its cores (a correctness check, not a speed-up)."""
    import torch

    if device == "cuda" and torch.cuda.device_count() < 2:
        count = torch.cuda.device_count()
        return {"skipped": f"needs 2 GPUs; this machine has {count}"}
    dtype = "bfloat16" if device == "cuda" else "float32"
    runs: dict[int, dict[str, Any]] = {}
    for size in (1, 2):
        args = ["--device", device, "--dtype", dtype, "--tp-size", str(size)]
        with berth_server("serve", *args, name=f"gpu-check-tp{size}") as srv:
            srv.wait_ready(timeout=600)
            answers = [
                berth_answer(srv.base_url, q, logprobs=False)["text"] for q in PARITY_QUESTIONS
            ]
            body = {
                "text": "Tell me a long story.",
                "sampling_params": {"max_new_tokens": TP_DECODE_TOKENS, "ignore_eos": True},
            }
            started = time.perf_counter()
            httpx.post(f"{srv.base_url}/generate", json=body, timeout=600).raise_for_status()
            per_token_ms = (time.perf_counter() - started) * 1000 / TP_DECODE_TOKENS
        runs[size] = {"answers": answers, "ms_per_token": per_token_ms}
    equal = sum(a == b for a, b in zip(runs[1]["answers"], runs[2]["answers"]))
    return {
        "dtype": dtype,
        "equal": equal,
        "prompts": len(PARITY_QUESTIONS),
        "answers_tp2": runs[2]["answers"],
        "ms_per_token": {"tp1": runs[1]["ms_per_token"], "tp2": runs[2]["ms_per_token"]},
    }


def dummy_model_dir(root: Path, tiny: bool) -> Path:
    """A `--load-format dummy` directory: the 1B Llama shape, or a tiny one for the CPU smoke."""
    embedded = Path(resolve_model(EMBEDDED_MODEL).path)
    config = llama_1b_config()
    if tiny:
        config.update(TINY_LLAMA)
    return write_dummy_model_dir(root / "dummy-llama", config, embedded)


def bench_model(
    name: str, model_args: list[str], cfg: CheckConfig, tokenizer: Any
) -> dict[str, Any]:
    """Part 3 for one model: a fresh server, one row per concurrency."""
    max_running = max(cfg.concurrency)
    args = ["--device", cfg.device, "--max-running-requests", str(max_running), *model_args]
    started = time.perf_counter()
    with berth_server("serve", *args, *cfg.server_args, name=f"gpu-check-{name}") as srv:
        srv.wait_ready(timeout=600)
        ready_s = time.perf_counter() - started
        info = httpx.get(f"{srv.base_url}/get_server_info", timeout=30, trust_env=False).json()
        rows = []
        for concurrency in cfg.concurrency:
            count = 3 if concurrency == 1 else cfg.waves * concurrency
            requests = random_workload(
                tokenizer,
                count,
                (cfg.input_len, cfg.input_len),
                (cfg.output_len, cfg.output_len),
                seed=concurrency,
            )
            bench = BenchConfig(
                base_url=srv.base_url, concurrency=concurrency, disable_tqdm=True, label=name
            )
            log(f"{name}: {count} requests at concurrency {concurrency}")
            result = run_benchmark(bench, requests)
            rows.append(
                {
                    "concurrency": concurrency,
                    "requests": count,
                    "completed": result["completed"],
                    "failed": result["failed"],
                    "errors": result["errors"],
                    "output_tok_s": result["output_throughput"],
                    "ttft_p50_ms": result["ttft_ms"]["p50"],
                    "decode_tok_s_p50": result["decode_tok_s"]["p50"],
                }
            )
    engine = info.get("engine", {})
    return {
        "model": name,
        "ready_s": ready_s,
        "attention_backend": engine.get("attention_backend"),
        "cuda_graph_max_bs": engine.get("cuda_graph_max_bs"),
        "cuda_graph_capture_s": engine.get("cuda_graph_capture_s"),
        "rows": rows,
    }


def run_check(cfg: CheckConfig) -> dict[str, Any]:
    """All three parts; the report the table and the JSON are made from."""
    import torch

    report: dict[str, Any] = {
        "config": asdict(cfg),
        "device": device_name(cfg.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": _commit(),
    }
    started = time.perf_counter()
    if cfg.tests:
        log("part 1: pytest -m gpu")
        report["tests"] = run_gpu_tests(cfg.device)
    if cfg.parity:
        log("part 2: greedy parity with HF transformers")
        report["parity"] = check_parity(cfg.device)
    if cfg.tensor_parallel:
        log("part 2b: tensor parallelism (--tp-size 2)")
        report["tensor_parallel"] = check_tensor_parallel(cfg.device)
    if cfg.models:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(EMBEDDED_MODEL).path)
        report["bench"] = []
        with tempfile.TemporaryDirectory(prefix="berth-gpu-check-") as tmp:
            for name in cfg.models:
                log(f"part 3: {name}")
                if name == "embedded":
                    model_args: list[str] = []
                else:
                    model_dir = dummy_model_dir(Path(tmp), tiny=cfg.device == "cpu")
                    model_args = ["--model", str(model_dir), "--load-format", "dummy"]
                report["bench"].append(bench_model(name, model_args, cfg, tokenizer))
    report["seconds"] = time.perf_counter() - started
    report["passed"] = passed(report)
    return report


def passed(report: dict[str, Any]) -> bool:
    """Tests green, every parity answer equal to HF's, every benchmark request answered."""
    ok = report.get("tests", {"passed": True})["passed"]
    ok &= all(p["equal"] for p in report.get("parity", {"prompts": []})["prompts"])
    return ok and all(r["failed"] == 0 for m in report.get("bench", []) for r in m["rows"])


def _commit() -> str | None:
    proc = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    return proc.stdout.strip() or None


def render(report: dict[str, Any]) -> str:
    """The table a person reads: one line per part, one row per model and concurrency."""
    lines = [
        f"Berth GPU check on {report['device']} (torch {report['torch']}, "
        f"Python {report['python']}, commit {report['commit']}), {report['seconds']:.0f} s",
    ]
    if "tests" in report:
        tests = report["tests"]
        lines.append(f"tests (pytest -m gpu): {tests['summary'] or 'no output'}")
    if "tensor_parallel" in report:
        tp = report["tensor_parallel"]
        if "skipped" in tp:
            lines.append(f"tensor parallelism: skipped ({tp['skipped']})")
        else:
            ms = tp["ms_per_token"]
            lines.append(
                f"tensor parallelism ({tp['dtype']}): {tp['equal']}/{tp['prompts']} answers on "
                f"--tp-size 2 equal to one process's; one stream {_num(ms['tp1'], 1)} ms/token "
                f"at TP 1, {_num(ms['tp2'], 1)} at TP 2"
            )
    if "parity" in report:
        parity = report["parity"]
        prompts = parity["prompts"]
        equal = sum(p["equal"] for p in prompts)
        lines.append(
            f"parity with HF ({parity['dtype']}, up to {parity['max_tokens']} tokens): "
            f"{equal}/{len(prompts)} answers equal"
        )
        for p in prompts:
            mark = "=" if p["equal"] else "!"
            devs = ""
            if "berth_logprob_dev" in p:
                devs = (
                    f"  |logprob - fp32|: Berth {_num(p['berth_logprob_dev'], 3)}, "
                    f"HF {_num(p['hf_logprob_dev'], 3)}"
                )
            lines.append(f"  {mark} {p['question']!r}: {p['berth']!r}{devs}")
            if not p["equal"]:
                lines.append(f"    HF: {p['hf']!r}")
    if report.get("bench"):
        header = [
            "model",
            "concurrency",
            "requests",
            "output tok/s",
            "per-stream tok/s p50",
            "TTFT p50 ms",
            "failed",
            "ready s",
            "graphs s",
        ]
        rows = [
            [
                m["model"],
                str(r["concurrency"]),
                str(r["requests"]),
                _num(r["output_tok_s"], 0),
                _num(r["decode_tok_s_p50"], 0),
                _num(r["ttft_p50_ms"], 0),
                str(r["failed"]),
                _num(m["ready_s"], 1),
                _num(m["cuda_graph_capture_s"], 1) if m["cuda_graph_max_bs"] else "-",
            ]
            for m in report["bench"]
            for r in m["rows"]
        ]
        lines += ["", _table(header, rows, right_from=1)]
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> tuple[CheckConfig, Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: concurrency 1 and 4, 32 tokens in and 16 out, one wave; on CPU the "
        "dummy model is a 2-layer one",
    )
    parser.add_argument("--concurrency", type=_ints, default=None, help="e.g. 1,32,256")
    parser.add_argument("--models", default="embedded,dummy-1b", help="embedded,dummy-1b")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-tp", action="store_true", help="skip the tensor-parallel part")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "gpu-check.json")
    parser.add_argument("server_args", nargs="*", help="extra `berth serve` flags, after --")
    args = parser.parse_args(argv)
    cfg = CheckConfig(
        device=args.device,
        models=[m for m in args.models.split(",") if m],
        tests=not args.skip_tests,
        parity=not args.skip_parity,
        tensor_parallel=not args.skip_tp,
        server_args=args.server_args,
    )
    unknown = set(cfg.models) - {"embedded", "dummy-1b"}
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}; choose from embedded, dummy-1b")
    if args.quick:
        cfg.concurrency, cfg.input_len, cfg.output_len, cfg.waves = [1, 4], 32, 16, 1
    if args.concurrency:
        cfg.concurrency = args.concurrency
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device (use --device cpu on a CPU)")
    return cfg, args.out


def main(argv: list[str] | None = None) -> int:
    cfg, out = parse_args(argv)
    report = run_check(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_finite(report), indent=2) + "\n")
    print(render(report))
    log(f"wrote {out}")
    return 0 if report["passed"] else 1


def _finite(value: Any) -> Any:
    """`value` with NaN as null: strict JSON has no NaN (a figure with no samples)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
