"""manifest.json as typed data: what the build writes, and what `edgetune verify` accepts.

A manifest may come from someone else's archive, so every field an input controls is bounded (strings,
lists, the files it lists), checksums are 64 lowercase hex digits and a listed file is a relative path
that stays inside the artifact. The fields `verify` needs are required; every other one may be absent
(a hand-made manifest, or an older edgetune's), and an absent field stays absent when written back:
`Manifest.text()` gives the same bytes as the JSON it was read from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PlainValidator,
    StringConstraints,
    ValidationError,
)
from pydantic_core import ErrorDetails

from edgetune.errors import InputError

MAX_TEXT = 4096
"""Characters in one string of a manifest: names, versions, reasons."""
MAX_ENTRIES = 10_000
"""Entries in one list or object of a manifest (an archive holds at most 10000 files)."""
MAX_PATH = 1024
"""Characters in the relative path of a listed file."""
MAX_RANK = 64
"""Dimensions of one model input."""


def _number(value: Any) -> int | float:
    """An int stays an int and a float a float (so the bytes written back are the bytes read); no bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, found {type(value).__name__}")
    return value


def _inside(name: str) -> str:
    """A listed file: a relative POSIX path that neither leaves the artifact nor names a drive."""
    parts = PurePosixPath(name).parts
    if not parts or name.startswith(("/", "\\")) or ".." in parts or "\\" in name or ":" in parts[0]:
        raise ValueError("points outside the artifact; expected a relative path inside it")
    if "\x00" in name:
        raise ValueError("holds a NUL character; no file of an artifact does")
    return name


Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
Number = Annotated[int | float, PlainValidator(_number)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
ArtifactPath = Annotated[str, StringConstraints(max_length=MAX_PATH), AfterValidator(_inside)]
JsonObject = Annotated[dict[Text, JsonValue], Field(max_length=MAX_ENTRIES)]


class _Part(BaseModel):
    """Every part of a manifest: exact types (no "1" for 1, no 1 for true), no field it does not define."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ModelInput(_Part):
    name: Text
    shape: Annotated[list[int], Field(max_length=MAX_RANK)] | None = None
    dtype: Text | None = None


class ModelFacts(_Part):
    inputs: Annotated[list[ModelInput], Field(max_length=MAX_ENTRIES)]
    outputs: Annotated[list[Text], Field(max_length=MAX_ENTRIES)]
    name: Text | None = None
    sha256: Sha256 | None = None


class TargetFacts(_Part):
    device: Text
    arch: Text
    name: Text | None = None
    profile: Text | None = None
    isa: Text | None = None
    tvm_target: JsonObject | None = None
    tvm_host: JsonObject | None = None


class RecipeFacts(_Part):
    name: Text | None = None
    sha256: Sha256 | None = None


class ToolchainFacts(_Part):
    """`Toolchain.describe()`: the compilers the library was linked with."""

    cc: Text | None = None
    cc_version: Text | None = None
    cxx: Text | None = None
    nvcc: Text | None = None


class TuningFacts(_Part):
    search: Text | None = None
    trials_per_task: int | None = None
    time_budget_min: Number | None = None
    seed: int | None = None
    winograd: bool | None = None
    tasks_total: int | None = None
    trials_total: int | None = None
    tasks: Annotated[list[JsonObject], Field(max_length=MAX_ENTRIES)] = []


class LatencyFacts(_Part):
    """Milliseconds, None when not measured; the reference keeps the key it has always had."""

    tuned: Number | None = None
    untuned: Number | None = None
    onnxruntime: Number | None = None


class ThreadWaitFacts(_Part):
    """How the artifact's CPU threads wait for work (`run.py` and `deploy` set TVM's spin count from io.json;
    "pool": `run.py` runs the kernels in edgetune's thread pool, the artifact's threads.so), who chose it (the
    build, measuring; or the recipe's `package.thread_wait`), and the tuned model's latencies, in ms, with them
    spinning, sleeping and in edgetune's pool: idle, and beside a low-priority busy process the build started
    (None: not timed that way here). `timed_beside_other_programs`: other programs held cores while it was timed "idle", so
    neither idle figure is an idle machine's."""

    policy: Literal["spin", "sleep", "pool"]
    chosen_by: Literal["measured", "recipe"] = "measured"
    spinning_ms: Number | None = None
    sleeping_ms: Number | None = None
    spinning_busy_ms: Number | None = None
    sleeping_busy_ms: Number | None = None
    pooled_ms: Number | None = None
    pooled_busy_ms: Number | None = None
    timed_beside_other_programs: bool = False


class Verification(_Part):
    """The tolerances, and once the verify stage ran: whether the artifact's output matched, or why not run."""

    rtol: Number
    atol: Number
    reference: Text | None = None
    matches: bool | None = None
    max_abs_error: Number | None = None
    methods: Annotated[list[Text], Field(max_length=MAX_ENTRIES)] = []
    not_run: Text | None = None


class Manifest(_Part):
    """manifest.json. `files` is what `write_manifest` lists: the sha256 of every other file of the artifact."""

    model: ModelFacts
    target: TargetFacts
    verification: Verification
    files: Annotated[dict[ArtifactPath, Sha256], Field(max_length=MAX_ENTRIES)]
    edgetune_version: Text | None = None
    build_inputs_sha256: Sha256 | None = None
    recipe: RecipeFacts = Field(default_factory=RecipeFacts)
    versions: Annotated[dict[Text, Text], Field(max_length=MAX_ENTRIES)] = {}
    toolchain: ToolchainFacts = Field(default_factory=ToolchainFacts)
    cuda_kernels: Text | None = None
    runtime_bundled: bool | None = None
    tuning: TuningFacts = Field(default_factory=TuningFacts)
    latency_ms: LatencyFacts = Field(default_factory=LatencyFacts)
    measured_on: Text | None = None
    thread_wait: ThreadWaitFacts | None = None

    def text(self) -> str:
        """The exact bytes of manifest.json: only the fields it was made or read with."""
        return manifest_text(self.model_dump(exclude_unset=True))


def manifest_text(fields: Mapping[str, Any]) -> str:
    """A manifest's JSON object as manifest.json's bytes: sorted keys, two-space indent, ASCII, Python's float
    repr. Signatures and reproducible archives depend on every byte, so nothing else formats a manifest."""
    return json.dumps(fields, indent=2, sort_keys=True) + "\n"


def parse_manifest(fields: Any, source: Path) -> Manifest:
    """`fields` (a manifest's JSON) as a Manifest; InputError with one message per bad field, each naming
    `source` and the field."""
    try:
        return Manifest.model_validate(fields)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = _field_name(error["loc"])
            problems.append(f"{source}: {where}: {_problem(error)}" if where else f"{source}: {_problem(error)}")
        raise InputError(problems) from None


def _field_name(loc: tuple[int | str, ...]) -> str:
    """pydantic's location in the manifest's own notation: `model.inputs[0].name`, `files['a/b']`."""
    text, part = "", Manifest
    for step in loc:
        if step == "[key]":  # the key of the entry just named is what is wrong
            continue
        if part is not None and isinstance(step, str):  # a field of a part (or one it does not define)
            text += f".{step}" if text else step
            field = part.model_fields.get(step)
            part = _part_of(field.annotation) if field is not None else None
        else:  # an entry of a list (keeps its part: model.inputs[0] is a ModelInput) or of an object
            text += f"[{step}]" if isinstance(step, int) else f"[{step!r}]"
    return text


def _part_of(annotation: Any) -> type[_Part] | None:
    """The manifest part a field holds, itself or as list entries; None for plain values and JSON objects."""
    if isinstance(annotation, type) and issubclass(annotation, _Part):
        return annotation
    return next((p for p in map(_part_of, get_args(annotation)) if p is not None), None)


_EXPECTED = {
    "string_type": "a string", "int_type": "an integer", "bool_type": "true or false", "list_type": "a list",
    "float_type": "a number", "dict_type": "an object", "model_type": "an object",
}


def _problem(error: ErrorDetails) -> str:
    kind, context = error["type"], error.get("ctx", {})
    if kind == "missing":
        return "missing (an edgetune manifest has it)"
    if kind == "extra_forbidden":
        return "not a field of an edgetune manifest"
    if kind == "string_pattern_mismatch":
        return "expected a sha256 (64 hex digits)"
    if kind == "string_too_long":
        return f"longer than {context['max_length']} characters"
    if kind == "too_long":
        return f"more than {context['max_length']} entries"
    if kind == "value_error":
        return str(context["error"])
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, found {type(error['input']).__name__}"
    return error["msg"]
