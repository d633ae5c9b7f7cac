"""ServerArgs: one flag per field, defaults from the dataclass, validation as usage errors."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from berth_runtime.server_args import BUILTIN_MODEL, ServerArgs


def parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(list(argv)))


def test_every_field_has_a_flag_with_help():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(ServerArgs):
        assert f.name in flags, f"no flag for {f.name}"
        assert flags[f.name].help, f"no help for {f.name}"


def test_defaults_round_trip():
    assert parse() == ServerArgs()
    assert parse().model == BUILTIN_MODEL


def test_flags_parse_to_typed_values():
    args = parse(
        "--port",
        "8000",
        "--dtype",
        "bfloat16",
        "--disable-radix-cache",
        "--dp-rank",
        "3",
        "--graceful-shutdown-timeout",
        "2.5",
        "--schedule-policy",
        "lpm",
    )
    assert (args.port, args.dtype, args.disable_radix_cache, args.dp_rank) == (
        8000,
        "bfloat16",
        True,
        3,
    )
    assert args.graceful_shutdown_timeout == 2.5
    assert args.schedule_policy == "lpm"


def test_invalid_choice_is_rejected_by_argparse():
    with pytest.raises(SystemExit):
        parse("--dtype", "int3")


def test_load_format_is_auto_or_dummy():
    assert parse().load_format == "auto"
    assert parse("--load-format", "dummy").load_format == "dummy"
    with pytest.raises(SystemExit):
        parse("--load-format", "pt")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"port": 0},
        {"max_running_requests": 0},
        {"dp_rank": -1},
        {"tp_size": 0},
        {"gguf_q4_max_batch": -1},
    ],
)
def test_invalid_values_raise(kwargs):
    with pytest.raises(ValueError):
        ServerArgs(**kwargs)


def test_gguf_q4_max_batch_flag():
    assert ServerArgs().gguf_q4_max_batch is None  # auto: resolved by the model runner
    assert parse("--gguf-q4-max-batch", "8").gguf_q4_max_batch == 8
    assert parse("--gguf-q4-max-batch", "0").gguf_q4_max_batch == 0


def test_attention_backend_flag():
    assert ServerArgs().attention_backend == "auto"
    assert parse("--attention-backend", "torch_native").attention_backend == "torch_native"
    assert parse("--attention-backend", "berth_cpu").attention_backend == "berth_cpu"
    with pytest.raises(SystemExit):
        parse("--attention-backend", "flashinfer")


def test_served_model_name():
    assert ServerArgs().model_name == "smollm2-135m-instruct"
    assert ServerArgs(model="/models/Llama-3-8B/").model_name == "Llama-3-8B"
    assert ServerArgs(model="/m/x.gguf").model_name == "x"
    assert ServerArgs(served_model_name="chat").model_name == "chat"


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("BERTH_API_KEY", "k")
    assert ServerArgs().api_key == "k"
    assert ServerArgs(api_key="flag").api_key == "flag"


def test_deterministic_inference_flag_and_what_it_cannot_run_with():
    assert parse("--enable-deterministic-inference").enable_deterministic_inference
    assert not parse().enable_deterministic_inference
    with pytest.raises(ValueError, match="CPU only, not --device cuda"):
        parse("--enable-deterministic-inference", "--device", "cuda")
    with pytest.raises(ValueError, match="needs the berth_cpu attention backend"):
        parse("--enable-deterministic-inference", "--attention-backend", "torch_native")


def test_speculative_flags_and_what_they_cannot_run_with():
    args = parse("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "5")
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens) == ("ngram", 5)
    assert parse().speculative_algorithm == "none"
    with pytest.raises(ValueError, match="CPU only"):
        parse("--speculative-algorithm", "ngram", "--device", "cuda")
    with pytest.raises(ValueError, match="needs the berth_cpu attention backend"):
        parse("--speculative-algorithm", "ngram", "--attention-backend", "torch_native")
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens must be positive"):
        parse("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "0")
