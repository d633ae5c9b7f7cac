"""Spec fields: one declaration gives the CRD's schema and the operator's reading of a value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from berth_operator.spec.fields import (
    Report,
    Rule,
    String,
    array,
    boolean,
    integer,
    number,
    obj,
    object_schema,
    optional,
    pass_through,
    quantity,
    read_object,
    spec_object,
    string,
    string_map,
)


@spec_object("A reference.")
@dataclass(frozen=True)
class Ref:
    name: str = string(
        "The name.",
        required=True,
        max_length=253,
        operator_pattern=r"^[a-z]+$",
        what="a lowercase name",
    )


@spec_object("Passed through.", preserve_unknown=True)
@dataclass(frozen=True)
class Open:
    key: str = string("The key.", required=True)


def _unique(item: dict[str, Any], kept: list[dict[str, Any]], report: Report) -> bool:
    if item in kept:
        report("name", "twice")
        return False
    return True


@spec_object("Inner.")
@dataclass(frozen=True)
class Inner:
    size: int = integer("A size.", 2, minimum=1, maximum=8)


@spec_object("A thing.", rules=(Rule("self.low <= self.high", "low must not exceed high"),))
@dataclass(frozen=True)
class Thing:
    uri: str = string(
        "A long text.", "x", max_length=512, operator_max_length=8, pattern=r"^[a-z]+$", what="ok"
    )
    low: int = integer("Low.", 1, minimum=0)
    high: int = integer("High.", 4, minimum=0)
    ratio: float = number("Ratio.", 4.0, exclusive_minimum=0, maximum=10)
    flag: bool = boolean("A flag.", False, schema_default=False)
    cpu: str = quantity("CPU.", "1")
    inner: Inner = obj(Inner, schema_default=True)
    kept: Inner = obj(Inner)
    ref: Ref | None = optional(Ref, json="theRef")
    refs: tuple[dict[str, Any], ...] = array(
        "Refs.", Ref, max_items=2, map_keys=("name",), each=_unique
    )
    words: tuple[str, ...] = array("Words.", String("A word.", max_length=3))
    opens: tuple[dict[str, Any], ...] = array("Open objects.", Open)
    labels: tuple[tuple[str, str], ...] = string_map("Labels.")
    raw: dict[str, Any] | None = pass_through("Anything.")

    def check(self, report: Report) -> None:
        if self.low > self.high:
            report(None, f"low ({self.low}) must not exceed high ({self.high})")


def read(raw: Any) -> tuple[Thing | None, list[str]]:
    problems: list[str] = []
    return read_object(Thing, raw, "thing", problems), problems


SCHEMA = object_schema(Thing)
PROPS = SCHEMA["properties"]


def test_the_schema_says_the_declared_constraints_and_not_the_operators_own() -> None:
    assert list(PROPS) == [
        "uri",
        "low",
        "high",
        "ratio",
        "flag",
        "cpu",
        "inner",
        "kept",
        "theRef",
        "refs",
        "words",
        "opens",
        "labels",
        "raw",
    ]
    assert PROPS["uri"] == {
        "type": "string",
        "description": "A long text.",
        "default": "x",
        "maxLength": 512,
        "pattern": "^[a-z]+$",
    }
    assert PROPS["theRef"]["properties"]["name"] == {
        "type": "string",
        "description": "The name.",
        "maxLength": 253,
    }
    assert PROPS["theRef"]["required"] == ["name"]
    assert SCHEMA["x-kubernetes-validations"] == [
        {"rule": "self.low <= self.high", "message": "low must not exceed high"}
    ]


def test_defaults_reach_the_schema_as_declared() -> None:
    assert PROPS["ratio"]["default"] == 4 and isinstance(PROPS["ratio"]["default"], int)
    assert PROPS["ratio"]["exclusiveMinimum"] is True and PROPS["ratio"]["minimum"] == 0
    assert "default" not in PROPS["flag"]  # schema_default=False
    assert PROPS["inner"]["default"] == {} and "default" not in PROPS["kept"]
    assert "default" not in PROPS["theRef"] and "default" not in PROPS["refs"]
    assert PROPS["cpu"]["x-kubernetes-int-or-string"] is True


def test_lists_maps_and_pass_through_objects() -> None:
    assert PROPS["refs"]["x-kubernetes-list-type"] == "map"
    assert PROPS["refs"]["x-kubernetes-list-map-keys"] == ["name"]
    assert PROPS["refs"]["maxItems"] == 2
    assert PROPS["words"]["items"] == {"type": "string", "description": "A word.", "maxLength": 3}
    assert PROPS["opens"]["items"]["x-kubernetes-preserve-unknown-fields"] is True
    assert PROPS["labels"]["additionalProperties"] == {"type": "string"}
    assert PROPS["raw"]["x-kubernetes-preserve-unknown-fields"] is True


def test_nothing_given_reads_as_the_defaults() -> None:
    thing, problems = read(None)
    assert problems == []
    assert thing == Thing()
    assert thing.inner == Inner(2) and thing.ref is None and thing.refs == ()


def test_values_are_read_into_their_python_form() -> None:
    thing, problems = read(
        {
            "cpu": 4,
            "ratio": 2,
            "theRef": {"name": "abc"},
            "refs": [{"name": "a"}, {"name": "b"}],
            "opens": [{"key": "k", "extra": {"kept": True}}],
            "labels": {"b": "2", "a": "1"},
            "raw": {"anything": [1]},
        }
    )
    assert problems == []
    assert thing is not None
    assert thing.cpu == "4" and thing.ratio == 2.0 and isinstance(thing.ratio, float)
    assert thing.ref == Ref("abc")
    assert thing.refs == ({"name": "a"}, {"name": "b"})
    assert thing.opens == ({"key": "k", "extra": {"kept": True}},)  # as written
    assert thing.labels == (("a", "1"), ("b", "2"))
    assert thing.raw == {"anything": [1]}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"uri": "abcdefghi"}, "thing.uri: must be 0 to 8 characters long"),  # the operator's 8
        ({"uri": "ABC"}, "thing.uri: 'ABC' is not ok"),
        ({"low": "1"}, "thing.low: must be an integer, got '1'"),
        ({"low": True}, "thing.low: must be an integer, got True"),
        ({"low": -1}, "thing.low: must be at least 0, got -1"),
        ({"ratio": 0}, "thing.ratio: must be greater than 0, got 0"),
        ({"ratio": 11}, "thing.ratio: must be at most 10, got 11"),
        ({"flag": "yes"}, "thing.flag: must be true or false, got 'yes'"),
        ({"cpu": "lots"}, "thing.cpu: 'lots' is not a quantity such as 500m, 2 or 16Gi"),
        ({"inner": {"size": 9}}, "thing.inner.size: must be at most 8, got 9"),
        ({"inner": 3}, "thing.inner: must be an object, got 3"),
        ({"theRef": {}}, "thing.theRef.name: required"),
        ({"theRef": {"name": "Abc"}}, "thing.theRef.name: 'Abc' is not a lowercase name"),
        ({"refs": [{"name": "a"}, {"name": "a"}]}, "thing.refs[1].name: twice"),
        ({"refs": [{"name": "a"}] * 3}, "thing.refs: must have at most 2 items, got 3"),
        ({"words": ["abcd"]}, "thing.words[0]: must be 0 to 3 characters long"),
        ({"labels": {"a": 1}}, "thing.labels: values must be strings (quote them in YAML): a"),
        ({"raw": []}, "thing.raw: must be an object, got []"),
        ({"low": 5, "high": 4}, "thing: low (5) must not exceed high (4)"),
        ({"bogus": 1}, "thing.bogus: unknown field (known here: cpu, flag, high, inner, kept, "),
    ],
)
def test_each_problem_names_the_field_and_the_fix(raw: dict[str, Any], expected: str) -> None:
    thing, problems = read(raw)
    assert any(p.startswith(expected) for p in problems), problems


def test_an_invalid_value_leaves_the_default_and_every_problem_is_reported() -> None:
    problems: list[str] = []
    thing = read_object(Thing, {"low": -1, "high": "x", "uri": "A"}, "thing", problems)
    assert thing is not None and (thing.low, thing.high, thing.uri) == (1, 4, "x")
    assert len(problems) == 3


def test_an_object_missing_a_required_field_reads_as_none_and_skips_its_checks() -> None:
    problems: list[str] = []
    assert read_object(Ref, {"name": "Bad"}, "ref", problems) is None
    # An invalid value is no value: the name is both wrong and missing.
    assert problems == ["ref.name: 'Bad' is not a lowercase name", "ref.name: required"]
