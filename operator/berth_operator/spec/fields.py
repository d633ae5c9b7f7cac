"""Spec fields: each declares its OpenAPI schema and how the operator reads it, in one place.

A spec class is a frozen dataclass whose fields come from the functions below (`string`,
`integer`, `number`, `boolean`, `quantity`, `obj`, `optional`, `array`, `string_map`,
`pass_through`); `@spec_object` gives the object its description and CEL rules. From those,
`object_schema` writes the CRD's OpenAPI schema and `read_object` parses a resource with the same
constraints, plus what only the operator checks: the `operator_*` constraints of a field, which
never reach the CRD, and the class's `check` method (rules across fields, what the runtime
supports).

Reading reports every problem as `<path>: <what to fix>` and carries on with the field's default,
so that one pass finds them all. An object that lacks a required field reads as None.

Each rule across fields is written twice, on purpose: as a CEL `Rule`, so that the API server
refuses a bad object at admission with the rule's message, and in the class's `check`, so that
the operator still reports InvalidSpec for an object that never met the rule (stored before the
rule existed, or admitted by an API server that does not run CEL).
`test_cel_rules_reject_what_the_parser_rejects` in tests/unit/operator/test_crd.py runs both on
the same bodies, which keeps them in step.

Why one module of ~600 lines: for each kind of field, the half that writes its schema and the half
that reads a resource must enforce the same constraints; kept side by side they stay in step.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from berth_operator.spec.formats import QUANTITY_PATTERN

T = TypeVar("T")
Problems = list[str]
Report = Callable[[str | None, str], None]  # (key under the object or None, message)

_INFO = "berth.spec"  # dataclasses.Field.metadata key of a field's FieldInfo
_OBJECT = "__spec_object__"  # class attribute holding an ObjectInfo
INVALID: Any = object()  # read() could not use the value: the field keeps its default

# The order of an OpenAPI node's keys in the generated CRD (kubebuilder's, roughly).
_KEY_ORDER = (
    "type",
    "anyOf",
    "format",
    "description",
    "default",
    "required",
    "x-kubernetes-validations",
    "enum",
    "exclusiveMinimum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "maxItems",
    "pattern",
    "x-kubernetes-int-or-string",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-preserve-unknown-fields",
    "additionalProperties",
    "items",
    "properties",
)


@dataclass(frozen=True)
class Rule:
    """A CEL rule the API server runs at admission (x-kubernetes-validations), and its message."""

    rule: str
    message: str

    def schema(self) -> dict[str, str]:
        return {"rule": self.rule, "message": self.message}


@dataclass(frozen=True)
class ObjectInfo:
    description: str
    rules: tuple[Rule, ...] = ()
    # Keys not declared here are kept as written (a Pod API object passed through).
    preserve_unknown: bool = False


def spec_object(
    description: str, *, rules: Iterable[Rule] = (), preserve_unknown: bool = False
) -> Callable[[type[T]], type[T]]:
    """Give a spec dataclass its description and CEL rules (apply on top of `@dataclass`)."""

    def decorate(cls: type[T]) -> type[T]:
        setattr(cls, _OBJECT, ObjectInfo(description, tuple(rules), preserve_unknown))
        return cls

    return decorate


# --- kinds: what a value may be ------------------------------------------------------------------


class Kind:
    """One JSON type with its constraints: its schema, and how to read a value of it."""

    description: str | None = None

    def schema(self) -> dict[str, Any]:
        raise NotImplementedError

    def read(self, value: Any, at: str, problems: Problems) -> Any:
        """The value to keep, or INVALID after recording why at `at`."""
        raise NotImplementedError


def _expect(value: Any, ok: bool, expected: str, at: str, problems: Problems) -> bool:
    if not ok:
        problems.append(f"{at}: must be {expected}, got {_show(value)}")
    return ok


@dataclass(frozen=True)
class String(Kind):
    description: str | None = None
    enum: tuple[str, ...] = ()
    max_length: int | None = None
    min_length: int | None = None
    pattern: str | None = None
    format: str | None = None
    # Checked by the operator only (the CRD does not say them): names the API server would
    # refuse only later, on a child, and the limits the operator has always applied.
    operator_pattern: str | None = None
    operator_max_length: int | None = None
    operator_min_length: int | None = None
    what: str | None = None  # what a matching value is, for "'x' is not <what>"

    def schema(self) -> dict[str, Any]:
        return {
            "type": "string",
            "format": self.format,
            "enum": list(self.enum) or None,
            "minLength": self.min_length,
            "maxLength": self.max_length,
            "pattern": self.pattern,
        }

    def read(self, value: Any, at: str, problems: Problems) -> Any:
        if not _expect(value, isinstance(value, str), "a string", at, problems):
            return INVALID
        if self.enum:
            if value not in self.enum:
                problems.append(f"{at}: {value!r} is not one of {', '.join(self.enum)}")
                return INVALID
            return value
        shortest = max(self.min_length or 0, self.operator_min_length or 0)
        limits = [n for n in (self.max_length, self.operator_max_length) if n is not None]
        longest = min(limits) if limits else None
        if len(value) < shortest or (longest is not None and len(value) > longest):
            problems.append(f"{at}: must be {shortest} to {longest} characters long")
            return INVALID
        for pattern in (self.pattern, self.operator_pattern):
            if pattern is not None and not re.match(pattern, value):
                problems.append(f"{at}: {value!r} is not {self.what or 'valid'}")
                return INVALID
        return value


@dataclass(frozen=True)
class Integer(Kind):
    description: str | None = None
    minimum: int | None = None
    maximum: int | None = None
    format: str | None = None

    def schema(self) -> dict[str, Any]:
        return {
            "type": "integer",
            "format": self.format,
            "minimum": self.minimum,
            "maximum": self.maximum,
        }

    def read(self, value: Any, at: str, problems: Problems) -> Any:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not _expect(value, ok, "an integer", at, problems):
            return INVALID
        return _bounded(value, self.minimum, self.maximum, at, problems)


@dataclass(frozen=True)
class Number(Kind):
    description: str | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None

    def schema(self) -> dict[str, Any]:
        exclusive = self.exclusive_minimum is not None
        return {
            "type": "number",
            "exclusiveMinimum": True if exclusive else None,
            "minimum": self.exclusive_minimum,
            "maximum": self.maximum,
        }

    def read(self, value: Any, at: str, problems: Problems) -> Any:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not _expect(value, ok, "a number", at, problems):
            return INVALID
        if self.exclusive_minimum is not None and value <= self.exclusive_minimum:
            problems.append(f"{at}: must be greater than {self.exclusive_minimum}, got {value}")
            return INVALID
        bounded = _bounded(value, None, self.maximum, at, problems)
        return bounded if bounded is INVALID else float(bounded)


@dataclass(frozen=True)
class Boolean(Kind):
    description: str | None = None

    def schema(self) -> dict[str, Any]:
        return {"type": "boolean"}

    def read(self, value: Any, at: str, problems: Problems) -> Any:
        return (
            value
            if _expect(value, isinstance(value, bool), "true or false", at, problems)
            else INVALID
        )


QUANTITY_EXAMPLE = "a quantity such as 500m, 2 or 16Gi"


@dataclass(frozen=True)
class Quantity(Kind):
    """A Kubernetes resource quantity (int-or-string); read as its string form."""

    description: str | None = None

    def schema(self) -> dict[str, Any]:
        return {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }

    def read(self, value: Any, at: str, problems: Problems) -> Any:
        ok = isinstance(value, str | int) and not isinstance(value, bool)
        if not _expect(value, ok, QUANTITY_EXAMPLE, at, problems):
            return INVALID
        if not re.match(QUANTITY_PATTERN, str(value)):
            problems.append(f"{at}: {value!r} is not {QUANTITY_EXAMPLE}")
            return INVALID
        return str(value)


@dataclass(frozen=True)
class StringMap(Kind):
    """String keys to string values (labels, annotations); read as sorted (key, value) pairs."""

    description: str | None = None

    def schema(self) -> dict[str, Any]:
        return {"type": "object", "additionalProperties": {"type": "string"}}

    def read(self, value: Any, at: str, problems: Problems) -> Any:
        if not _expect(value, isinstance(value, Mapping), "an object", at, problems):
            return INVALID
        bad = [k for k, v in value.items() if not isinstance(v, str)]
        if bad:
            problems.append(f"{at}: values must be strings (quote them in YAML): {', '.join(bad)}")
            return ()
        return tuple(sorted(value.items()))


@dataclass(frozen=True)
class PassThrough(Kind):
    """An object kept as written (a Pod API field); the API server checks it on the child."""

    description: str | None = None

    def schema(self) -> dict[str, Any]:
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}

    def read(self, value: Any, at: str, problems: Problems) -> Any:
        ok = isinstance(value, Mapping)
        return dict(value) if _expect(value, ok, "an object", at, problems) else INVALID


@dataclass(frozen=True)
class Object(Kind):
    """A nested spec class. `as_dict`: keep it as its Kubernetes dict (what a pod spec takes:
    the fields given, or the object as written when it passes unknown fields through)."""

    cls: type
    description: str | None = None
    as_dict: bool = False

    def schema(self) -> dict[str, Any]:
        return object_schema(self.cls, description=self.description)

    def read(self, value: Any, at: str, problems: Problems) -> Any:
        parsed = read_object(self.cls, value, at, problems)
        if parsed is None:
            return INVALID
        if not self.as_dict:
            return parsed
        if _object_info(self.cls).preserve_unknown and isinstance(value, Mapping):
            return dict(value)
        return to_dict(parsed)


# (item, the items kept so far, report at the item) -> whether to keep it
EachItem = Callable[[Any, list[Any], Report], bool]


@dataclass(frozen=True)
class Array(Kind):
    item: Kind
    description: str | None = None
    max_items: int | None = None
    # A map list: the API server refuses two items with the same keys.
    map_keys: tuple[str, ...] = ()
    each: EachItem | None = None  # what the operator checks across items (duplicates, ...)

    def schema(self) -> dict[str, Any]:
        return {
            "type": "array",
            "maxItems": self.max_items,
            "x-kubernetes-list-type": "map" if self.map_keys else None,
            "x-kubernetes-list-map-keys": list(self.map_keys) or None,
            "items": _node(self.item),
        }

    def read(self, value: Any, at: str, problems: Problems) -> Any:
        if not _expect(value, isinstance(value, list), "a list", at, problems):
            return INVALID
        if self.max_items is not None and len(value) > self.max_items:
            problems.append(f"{at}: must have at most {self.max_items} items, got {len(value)}")
        kept: list[Any] = []
        for i, raw in enumerate(value):
            item_at = f"{at}[{i}]"
            item = self.item.read(raw, item_at, problems)
            if item is INVALID:
                continue
            if self.each is None or self.each(item, kept, _reporter(item_at, problems)):
                kept.append(item)
        return tuple(kept)


# --- fields ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldInfo:
    kind: Kind
    json: str | None  # the JSON name; None: the attribute's name in camelCase
    schema_default: bool  # the CRD defaults it too (objects: to {})
    required: str | None  # the message when it is missing (or invalid), None if optional


def _field(
    kind: Kind,
    default: Any = None,
    *,
    json: str | None = None,
    schema_default: bool = True,
    required: bool | str = False,
    factory: Callable[[], Any] | None = None,
) -> Any:
    message = required if isinstance(required, str) else ("required" if required else None)
    metadata = {_INFO: FieldInfo(kind, json, schema_default, message)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def string(
    description: str,
    default: str | None = None,
    *,
    json: str | None = None,
    schema_default: bool = True,
    required: bool | str = False,
    **constraints: Any,
) -> Any:
    kind = String(description, **constraints)
    return _field(kind, default, json=json, schema_default=schema_default, required=required)


def enum(
    description: str,
    choices: tuple[str, ...],
    default: str | None = None,
    *,
    required: bool = False,
) -> Any:
    return _field(String(description, enum=choices), default, required=required)


def integer(description: str, default: int | None = None, **constraints: Any) -> Any:
    required = constraints.pop("required", False)
    return _field(Integer(description, **constraints), default, required=required)


def number(
    description: str, default: float | None = None, *, json: str | None = None, **constraints: Any
) -> Any:
    return _field(Number(description, **constraints), default, json=json)


def boolean(description: str, default: bool | None = None, *, schema_default: bool = True) -> Any:
    return _field(Boolean(description), default, schema_default=schema_default)


def quantity(description: str, default: str | None = None, *, schema_default: bool = True) -> Any:
    return _field(Quantity(description), default, schema_default=schema_default)


def string_map(description: str) -> Any:
    return _field(StringMap(description), ())


def pass_through(description: str) -> Any:
    return _field(PassThrough(description))


def obj(cls: type, *, schema_default: bool = False) -> Any:
    """A nested object that is always there (its defaults when not given); `schema_default`:
    the CRD defaults it to {} as well, so that its own defaults show in the stored object."""
    return _field(Object(cls), schema_default=schema_default, factory=cls)


def optional(cls: type, *, json: str | None = None) -> Any:
    """A nested object that is None unless given."""
    return _field(Object(cls), None, json=json)


def array(
    description: str,
    item: Kind | type,
    *,
    max_items: int | None = None,
    map_keys: tuple[str, ...] = (),
    each: EachItem | None = None,
) -> Any:
    kind = Array(_kind(item), description, max_items, map_keys, each)
    return _field(kind, ())


def _kind(item: Kind | type) -> Kind:
    return item if isinstance(item, Kind) else Object(item, as_dict=True)


def json_name(field: dataclasses.Field[Any]) -> str:
    info = _info(field)
    if info.json is not None:
        return info.json
    head, *rest = field.name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def _info(field: dataclasses.Field[Any]) -> FieldInfo:
    return field.metadata[_INFO]


def _object_info(cls: type) -> ObjectInfo:
    return getattr(cls, _OBJECT)


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


# --- reading -----------------------------------------------------------------------------------


def read_object(cls: type[T], raw: Any, at: str, problems: Problems) -> T | None:
    """Read one object of class `cls` from `raw` (None reads as {}); None if a required field is
    missing. Every problem goes to `problems` as "<at>.<key>: ..."."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        problems.append(f"{at}: must be an object, got {_show(raw)}")
        raw = {}
    info = _object_info(cls)
    values: dict[str, Any] = {}
    missing: list[tuple[str, str]] = []
    known = []
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = json_name(field)
        known.append(key)
        value = raw.get(key)
        parsed = INVALID
        if value is not None:
            parsed = _info(field).kind.read(value, f"{at}.{key}", problems)
        values[field.name] = _default(field) if parsed is INVALID else parsed
        required = _info(field).required
        if required is not None and values[field.name] is None:
            missing.append((key, required))
    if not info.preserve_unknown:
        for key in sorted(set(raw) - set(known)):
            listed = ", ".join(sorted(known)) or "none"
            problems.append(f"{at}.{key}: unknown field (known here: {listed})")
    for key, message in missing:
        problems.append(f"{at}.{key}: {message}")
    if missing:
        return None
    parsed_object = cls(**values)
    check = getattr(parsed_object, "check", None)
    if check is not None:
        check(_reporter(at, problems))
    return parsed_object


def _reporter(at: str, problems: Problems) -> Report:
    def report(key: str | None, message: str) -> None:
        problems.append(f"{at}.{key}: {message}" if key else f"{at}: {message}")

    return report


def to_dict(value: Any) -> dict[str, Any]:
    """A spec object as its JSON object: the fields that are set, by their JSON names."""
    result: dict[str, Any] = {}
    for field in dataclasses.fields(value):
        item = getattr(value, field.name)
        if item is not None:
            result[json_name(field)] = item
    return result


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bounded(
    value: Any, minimum: float | None, maximum: float | None, at: str, problems: Problems
) -> Any:
    if minimum is not None and value < minimum:
        problems.append(f"{at}: must be at least {minimum}, got {value}")
        return INVALID
    if maximum is not None and value > maximum:
        problems.append(f"{at}: must be at most {maximum}, got {value}")
        return INVALID
    return value


# --- the schema --------------------------------------------------------------------------------


def object_schema(
    cls: type, *, description: str | None = None, default: Any = None
) -> dict[str, Any]:
    """The OpenAPI v3 schema of a spec class, as the CRD carries it."""
    info = _object_info(cls)
    fields = dataclasses.fields(cls)
    required = [json_name(f) for f in fields if _info(f).required is not None]
    return _ordered(
        {
            "type": "object",
            "description": description or info.description,
            "default": default,
            "required": required or None,
            "x-kubernetes-validations": [rule.schema() for rule in info.rules] or None,
            "x-kubernetes-preserve-unknown-fields": True if info.preserve_unknown else None,
            "properties": {json_name(f): _field_schema(f) for f in fields},
        }
    )


def _field_schema(field: dataclasses.Field[Any]) -> dict[str, Any]:
    info = _info(field)
    node = _node(info.kind)
    if info.schema_default:
        if isinstance(info.kind, Object) and field.default_factory is not dataclasses.MISSING:
            node["default"] = {}
        elif field.default not in (None, (), dataclasses.MISSING):
            default = field.default
            # JSON has one number type: 4.0 is written as 4.
            node["default"] = (
                int(default) if isinstance(default, float) and default.is_integer() else default
            )
    return _ordered(node)


def _node(kind: Kind) -> dict[str, Any]:
    if isinstance(kind, Object):
        return kind.schema()
    return _ordered({**kind.schema(), "description": kind.description})


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    unknown = set(node) - set(_KEY_ORDER)
    assert not unknown, f"no place for {unknown} in the schema's key order"
    return {key: node[key] for key in _KEY_ORDER if node.get(key) is not None}
