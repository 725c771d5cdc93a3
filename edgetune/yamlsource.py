"""YAML documents that remember where each value came from, and pydantic errors made readable.

recipe.py and profiles.py both turn user YAML into typed models. Users need every problem at once,
each as "<file>:<line>: <dotted.path>: <what was expected>", so this module keeps the composed
YAML node tree next to the plain data and maps validation problems back onto it.
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import AfterValidator, AllowInfNan, BaseModel, BeforeValidator, ValidationError

from edgetune.errors import InputError

PathPart = str | int
"""One step of a location: a mapping key or a list index."""

M = TypeVar("M", bound=BaseModel)

MAX_FILE_BYTES = 256 * 1024
"""Largest YAML file read: a recipe or profile is a few KiB; anything near this is not one (and
PyYAML, in pure Python, takes seconds per 256 KiB)."""

MAX_NODES = 100_000
"""Most values a document may hold once its aliases are expanded (an alias bomb expands to billions)."""

MAX_DEPTH = 64
"""Deepest nesting of mappings and lists (a recipe needs about 6)."""

EXCERPT_CHARS = 60
"""Longest piece of an input value quoted in a message."""


def excerpt(text: object, limit: int = EXCERPT_CHARS) -> str:
    """`text` cut to `limit` characters with "..." and the full length, so no message repeats a huge input."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True)
class Problem:
    """One unlocated problem: where in the data (`path`) and what was expected (`message`).

    `at_key` points the line at the key itself rather than its value (unknown fields).
    """

    path: tuple[PathPart, ...]
    message: str
    at_key: bool = False

    def __str__(self) -> str:
        return f"{format_path(self.path)}: {self.message}"


class InvalidData(InputError):
    """Problems in data that has no YAML file of its own (e.g. profile overrides from a recipe).

    The message names data paths only; a caller that owns the YAML the data came from can put
    `found` under its own path and locate it with `YamlDocument.locate`.
    """

    def __init__(self, found: list[Problem], prefix: tuple[PathPart, ...] = ()):
        self.found = found
        super().__init__([str(Problem(prefix + p.path, p.message)) for p in found])


def format_path(path: Sequence[PathPart]) -> str:
    """`("fleet", 0, "profile")` -> `"fleet[0].profile"`; the empty path is `"(top level)"`."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{excerpt(part)}" if text else excerpt(part))
    return text or "(top level)"


def unknown_field(name: object, known: Iterable[str]) -> str:
    """Message for an unknown key, with the closest known key as a suggestion."""
    known = list(known)
    close = difflib.get_close_matches(str(name)[:200], known, n=1)
    if close:
        return f"unknown field; did you mean '{close[0]}'?"
    return f"unknown field; expected one of: {', '.join(known)}" if known else "unknown field"


def display_path(path: Path) -> str:
    """How a file is named in messages: relative to the working directory when it is inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


_YAML_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _float_from_yaml_text(value: object) -> object:
    # YAML 1.1 (PyYAML) reads `1e-4` as a string: its floats need a dot and a signed exponent.
    if isinstance(value, str) and _YAML_FLOAT.fullmatch(value.strip()):
        return float(value)
    return value


YamlFloat = Annotated[float, BeforeValidator(_float_from_yaml_text), AllowInfNan(False)]
"""A finite float that also accepts the `1e-4` spelling PyYAML leaves as a string (`.nan`/`.inf` refused)."""


def in_range(low: float, high: float, reason: str, low_open: bool = False) -> AfterValidator:
    """A range check whose message says why the bounds are what they are.

    Every number a user writes ends up sizing a loop, an allocation or a timeout, so each has one.
    """

    def check(value: float) -> float:
        above_low = value > low if low_open else value >= low
        if not (math.isfinite(value) and above_low and value <= high):
            lowest = f"more than {_number(low)}" if low_open else f"at least {_number(low)}"
            raise ValueError(f"must be {lowest} and at most {_number(high)} ({reason}), got {excerpt(value)}")
        return value

    return AfterValidator(check)


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


@dataclass(frozen=True)
class YamlDocument:
    """Parsed YAML: plain `data` (as yaml.safe_load gives) plus the node tree for line numbers."""

    name: str
    data: Any
    root: yaml.Node

    def line(self, path: Sequence[PathPart], at_key: bool = False) -> int:
        """1-based line for `path`: the value's line, the key's line for `at_key` or when the
        value is a block (mapping/list), and the enclosing mapping's line for a missing key."""
        node: yaml.Node = self.root
        key: yaml.Node | None = None
        for part in path:
            child = _child(node, part)
            if child is None:
                break
            key, node = child
        else:
            if at_key and key is not None:
                return key.start_mark.line + 1
        if isinstance(node, yaml.ScalarNode) or key is None:
            return node.start_mark.line + 1
        return key.start_mark.line + 1

    def locate(self, problems: Iterable[Problem]) -> list[str]:
        """Format problems as "<file>:<line>: <path>: <message>", in file order."""
        located = [(self.line(p.path, p.at_key), str(p)) for p in problems]
        return [f"{self.name}:{line}: {text}" for line, text in sorted(located, key=lambda x: x[0])]


def _child(node: yaml.Node, part: PathPart) -> tuple[yaml.Node | None, yaml.Node] | None:
    """(key node, value node) for one path step, or None when the step is not in the YAML."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                return key, value
    elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
        return None, node.value[part]
    return None


if yaml.__with_libyaml__:
    from yaml._yaml import CParser

    class _SafeLoader(yaml.composer.Composer, CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
        """yaml.SafeLoader with libyaml's parser (6x faster) under PyYAML's composer, which can be bounded."""

        def __init__(self, text: str):
            CParser.__init__(self, text)
            yaml.composer.Composer.__init__(self)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

else:
    _SafeLoader = yaml.SafeLoader  # type: ignore[misc,assignment]


class _BoundedLoader(_SafeLoader):
    """A safe loader that refuses nesting deeper than MAX_DEPTH (the composer recurses) and documents
    holding more than MAX_NODES values once aliases are expanded, counted while composing: each node's
    expanded size is the sum of its children's, so an alias costs one lookup, not its expansion.

    It also remembers the node being constructed, so a value Python cannot hold (a 5000-digit integer,
    30 February) gets a line number.
    """

    def __init__(self, text: str, name: str):
        super().__init__(text)
        self.name = name
        self.path: list[PathPart | None] = []
        self.sizes: dict[int, int] = {}
        self.current: yaml.Node | None = None

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        if len(self.path) >= MAX_DEPTH:
            event = self.peek_event()
            raise yaml.MarkedYAMLError(problem=f"nested deeper than {MAX_DEPTH} levels (a recipe needs about 6)",
                                       problem_mark=event.start_mark)
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            named = self.anchors.get(event.anchor)
            if isinstance(named, yaml.CollectionNode) and id(named) not in self.sizes:
                raise yaml.MarkedYAMLError(problem=f"the alias *{excerpt(event.anchor)} is inside the value it "
                                                   "names (a cycle)", problem_mark=event.start_mark)
        self.path.append(index.value if isinstance(index, yaml.ScalarNode) else index)  # type: ignore[arg-type]
        try:
            node = super().compose_node(parent, index)
            self._count(node)
        finally:
            self.path.pop()
        return node

    def _count(self, node: yaml.Node) -> None:
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            return
        size = 1 + sum(self.sizes.get(id(child), 1) for child in children)
        self.sizes[id(node)] = size
        if size > MAX_NODES:
            where = format_path([part for part in self.path if part is not None])
            raise InputError(f"{self.name}:{node.start_mark.line + 1}: {where}: holds more than {MAX_NODES} "
                             "values, counting what each YAML alias (*name) repeats; a recipe holds a few hundred")

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        self.current = node
        return super().construct_object(node, deep)


def parse_yaml(text: str, name: str) -> YamlDocument:
    """Parse one YAML mapping; syntax errors, duplicate keys, empty input, a non-mapping top level,
    oversized input, deep nesting and alias bombs become an InputError naming `name` and the line."""
    if len(text) > MAX_FILE_BYTES:
        raise InputError(f"{name}: {len(text)} characters; a YAML file may hold at most {MAX_FILE_BYTES} "
                         "(256 KiB; a recipe is a few KiB)")
    loader = _BoundedLoader(text, name)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        where = ""
        if exc.context and exc.context_mark:
            where = f" ({excerpt(exc.context)} that starts at line {exc.context_mark.line + 1})"
        raise InputError(f"{name}:{line}: invalid YAML: {excerpt(exc.problem or exc, 200)}{where}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{name}: invalid YAML: {excerpt(exc, 200)}") from None
    except (ValueError, OverflowError) as exc:  # e.g. int() of 5000 digits, a date that does not exist
        node = loader.current
        line = f":{node.start_mark.line + 1}" if node is not None else ""
        raise InputError(f"{name}{line}: invalid YAML value: {excerpt(exc, 200)}") from None
    finally:
        loader.dispose()
    if root is None:
        raise InputError(f"{name}: the file is empty; expected a YAML mapping of settings")
    if not isinstance(root, yaml.MappingNode):
        kind = "a list" if isinstance(root, yaml.SequenceNode) else f"the value {excerpt(repr(data))}"
        raise InputError(
            f"{name}:{root.start_mark.line + 1}: expected a YAML mapping of settings at the top level, got {kind}"
        )
    duplicates = [
        f"{name}:{key.start_mark.line + 1}: duplicate key '{excerpt(key.value)}' "
        "(YAML would silently keep only the last one)"
        for key in _duplicate_keys(root)
    ]
    if duplicates:
        raise InputError(duplicates)
    return YamlDocument(name=name, data=data, root=root)


def _duplicate_keys(node: yaml.Node, seen_nodes: set[int] | None = None) -> list[yaml.ScalarNode]:
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:  # anchors/aliases share nodes
        return []
    seen_nodes.add(id(node))
    found: list[yaml.ScalarNode] = []
    if isinstance(node, yaml.MappingNode):
        keys: set[str] = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in keys:
                    found.append(key)
                keys.add(key.value)
            found += _duplicate_keys(value, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            found += _duplicate_keys(item, seen_nodes)
    return found


def read_yaml(path: Path) -> YamlDocument:
    """Read and parse a YAML file; a missing or unreadable file is an InputError."""
    name = display_path(path)
    if not path.is_file():
        raise InputError(f"{name}: file not found" if not path.exists() else f"{name}: not a file")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise InputError(f"{name}: {size} bytes; a YAML file may be at most {MAX_FILE_BYTES} bytes "
                             "(256 KiB; a recipe is a few KiB)")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{name}: cannot read: {excerpt(exc, 200)}") from None
    return parse_yaml(text, name)


def validate(model: type[M], data: Any) -> tuple[M | None, list[Problem]]:
    """Validate `data` as `model`; on failure return every problem in plain words instead."""
    try:
        return model.model_validate(data), []
    except ValidationError as exc:
        return None, [_problem(model, err) for err in exc.errors()]


def _problem(model: type[BaseModel], err: Any) -> Problem:
    loc: tuple[PathPart, ...] = tuple(err["loc"])
    if loc and loc[-1] == "[key]":  # a bad dict key: point at the key
        return Problem(loc[:-1], _describe(err), at_key=True)
    if err["type"] == "extra_forbidden":
        known = _field_names(model, loc[:-1])
        return Problem(loc, unknown_field(loc[-1], known), at_key=True)
    return Problem(loc, _describe(err))


def _describe(err: Any) -> str:
    kind: str = err["type"]
    ctx: dict[str, Any] = err.get("ctx") or {}
    got = _show(err.get("input"))
    if kind == "missing":
        return "required field is missing"
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return excerpt(ctx["error"], 400)
    if kind == "literal_error":
        return f"expected {ctx['expected']}, got {got}"
    if kind == "too_short":
        return f"must have at least {ctx['min_length']} item(s)"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} item(s)"
    if kind == "string_too_short":
        return f"must have at least {ctx['min_length']} character(s), got {got}"
    if kind == "string_too_long":
        return f"must have at most {ctx['max_length']} characters, got {got}"
    bounds = {
        "greater_than": ("greater than", "gt"),
        "greater_than_equal": ("at least", "ge"),
        "less_than": ("less than", "lt"),
        "less_than_equal": ("at most", "le"),
    }
    if kind in bounds:
        words, key = bounds[kind]
        return f"must be {words} {ctx[key]}, got {got}"
    expected = {
        "int_type": "a whole number",
        "int_parsing": "a whole number",
        "int_from_float": "a whole number",
        "float_type": "a number",
        "float_parsing": "a number",
        "finite_number": "a finite number (not .nan or .inf)",
        "string_type": "text",
        "bool_type": "true or false",
        "bool_parsing": "true or false",
        "list_type": "a list",
        "dict_type": "a mapping (key: value pairs)",
        "model_type": "a mapping (key: value pairs)",
        "model_attributes_type": "a mapping (key: value pairs)",
    }
    if kind in expected:
        return f"expected {expected[kind]}, got {got}"
    return excerpt(err["msg"], 300)


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return excerpt(repr(value))


def _field_names(model: type[BaseModel], loc: Sequence[PathPart]) -> list[str]:
    """Field names (as written in YAML, i.e. aliases) of the model found at `loc`, for suggestions."""
    tp: Any = model
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            fields = {f.alias or n: f for n, f in tp.model_fields.items()}
            if part not in fields:
                return []
            tp = fields[part].annotation
        elif typing.get_origin(tp) in (list, dict):
            tp = typing.get_args(tp)[-1]
        else:
            return []
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [f.alias or n for n, f in tp.model_fields.items()]
    return []


def _unwrap(tp: Any) -> Any:
    """Strip Annotated[...] and `| None` so the model inside can be inspected."""
    while True:
        if typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            options = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(options) != 1:
                return tp
            tp = options[0]
        else:
            return tp
