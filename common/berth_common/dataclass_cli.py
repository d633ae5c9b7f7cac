"""DataclassCli: one `--flag` per field of a config dataclass, and the dataclass from the flags.

`ServerArgs` (`berth serve`) and `RouterArgs` (`berth router`) inherit it. Each field's metadata
gives its flag's help (`metadata={"help": ...}`); the flag is the field's name with dashes. From
the field's annotation:

- `bool`: a `store_true` flag;
- `metadata={"nargs": ...}`: a list flag, turned back into a tuple by `from_cli_args`;
- `Literal[...]`: its values are the flag's choices;
- `int ...` / `float ...` (`None` allowed): parsed as int / float; anything else as str.

Help text that does not mention the default gets ` [default: <default>]` appended (not for bool
and list flags).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

_T = TypeVar("_T", bound="DataclassCli")


class DataclassCli:
    """Mixin for a dataclass whose fields are all CLI flags (see the module docstring)."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one `--flag` per field, its default and help taken from the field."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if f.type == "bool":
                parser.add_argument(flag, action="store_true", help=help_text)
                continue
            if "nargs" in f.metadata:
                parser.add_argument(flag, nargs=f.metadata["nargs"], default=[], help=help_text)
                continue
            if "default" not in help_text:
                help_text = f"{help_text} [default: {f.default}]"
            kwargs: dict[str, Any] = {"default": f.default, "help": help_text}
            choices = _literal_choices(f.type)
            if choices:
                kwargs["choices"] = choices
            kwargs["type"] = _parse_type(f.type)
            parser.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls: type[_T], ns: argparse.Namespace) -> _T:
        """The dataclass from parsed args (attributes that are not fields are ignored)."""
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        values = {k: v for k, v in vars(ns).items() if k in names}
        for f in fields:
            if "nargs" in f.metadata:
                values[f.name] = tuple(values.get(f.name) or ())
        return cls(**values)


def _literal_choices(type_str: Any) -> list[str] | None:
    text = str(type_str)
    if not text.startswith("Literal["):
        return None
    return [part.strip().strip("'\"") for part in text[len("Literal[") : -1].split(",")]


def _parse_type(type_str: Any) -> Any:
    text = str(type_str)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str
