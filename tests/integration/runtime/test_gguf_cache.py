"""The GGUF conversion cache: a file converted once is reused, and a conversion that a newer file
at the same path replaced (a reinstall, a new download) is removed, not left to fill the disk."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from berth_runtime.models.loader import SOURCE_FILE, convert_gguf
from tests.tiny_models import tiny_gguf


def test_a_replaced_gguf_leaves_one_conversion(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first_home, second_home = tmp_path / "a", tmp_path / "b"
    first_home.mkdir()
    second_home.mkdir()
    gguf = first_home / "tiny.gguf"
    shutil.copyfile(tiny_gguf("qwen3"), gguf)
    first = convert_gguf(gguf, cache)
    assert convert_gguf(gguf, cache) == first  # reused while the file is unchanged
    assert (first / SOURCE_FILE).is_file()

    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file replaced
    second = convert_gguf(gguf, cache)
    assert second != first and (second / "config.json").is_file()
    assert not first.exists()

    # The same name at another path is another model: both conversions stay, and so does
    # whatever else lives in the cache.
    unrelated = cache / "control-plane"
    unrelated.mkdir()
    other = second_home / "tiny.gguf"
    shutil.copyfile(gguf, other)
    third = convert_gguf(other, cache)
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [second.name, third.name, unrelated.name]
    )
