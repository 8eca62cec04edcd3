"""The experiment spec (TOML) and its dataset (JSONL), checked with errors that name the key.

    name = "qa"
    [dataset]
    path = "samples.jsonl"      # relative to the spec file; one JSON object a line
    [[variants]]
    name = "solo"
    agent = "assistant"
    set = { temperature = 0.7 } # the keys `busctl replay --set` takes (agents.replay.SETTABLE);
                                # "AGENT.KEY" for another agent of a team
    [run]
    repeats = 3                 # each repeat gets seed + repeat when `seed` is given
    concurrency = 8
    [run.per_model]             # at most this many sessions at once of the variants on a model
    local = 2                   # (alias: the variant's model, else its agent's; `default`: none)
    # workspace = "sample"     # (default) each cell's tool calls in a folder of its own with
                                # its sample's `files` (bus.messages.RunWorkspace); or "shared"
    [[scorers]]
    kind = "number"

A variant's changes reach the model the way a replay fork's do: the runner loads them into the
gateway (`llm.replay` with no recorded replies, `fork = true`) for the experiment tag of each
variant and repeat, `E.<variant>.r<repeat>`, which every session of that cell carries.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import typing
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import msgspec

from agent_bus.agents import replay
from agent_bus.agents.gateway.wire import Seed
from agent_bus.agents.launch.topology import TurnBound
from agent_bus.agents.replay_wire import LiveOverrides
from agent_bus.bus import experiments
from agent_bus.bus.errors import AgentBusError, ConfigError
from agent_bus.bus.messages import MAX_WORKSPACE_BYTES, RunWorkspace, workspace_problem

NAME = experiments.NAME  # experiment and variant names: the tag `E.<variant>.r<N>` parses back
#: The gateway holds this many replays (overlays) at once (agents/gateway/process.py REPLAYS_KEPT).
MAX_OVERLAYS = 16
MAX_SAMPLE_BYTES = 1024 * 1024  # one dataset line; a larger one is a mistake, not a sample


class SpecError(ConfigError):
    """A spec or dataset problem; the text names the file and the key (or line)."""


class DatasetSection(msgspec.Struct, forbid_unknown_fields=True):
    path: str


class Variant(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    agent: str
    set: dict[str, Any] = msgspec.field(default_factory=dict)
    system_prompt_file: str = ""
    model: str = ""
    # An agent's tools are fixed when its runs start, on its coordinator: a variant with other
    # tools is another [[agents]] entry. Kept as a key so the error can say so.
    tools: list[str] | None = None


class RunSection(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    repeats: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 1
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 8
    # model alias -> sessions at once of the variants on it (besides `concurrency`, the total);
    # which alias a variant uses is known only on the running topology (its agent's model):
    # `experiment run` checks the keys, `check` only their form
    # (the range is checked in check_spec, where the error can name the key)
    per_model: dict[str, int] = msgspec.field(default_factory=dict)
    seed: Seed | None = None  # repeat r (from 1) sends seed + r - 1
    retries: Annotated[int, msgspec.Meta(ge=0, le=100)] = 2  # errors, not wrong answers
    max_turns: TurnBound | None = None  # per sample (the agent's max_iterations otherwise)
    timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None  # wall seconds per sample
    # per sample, the whole run tree (helpers asked included): past it the run is aborted and
    # the report counts it `limited`, scored 0 (runner.FAILURE_RULE), stop reason `limit` (0: none)
    token_limit: Annotated[int, msgspec.Meta(ge=0)] = 0
    cost_limit: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # seconds a cell whose coordinator died waits for its run to resume there (`busctl up`
    # restarts it) before it is retried elsewhere (agents.client.remote.RESUME_WAIT)
    resume_wait: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    # "sample": each cell's tool calls run in a fresh folder of its own on the tool workers,
    # with its sample's `files` (`.runs/E/<variant>.r<repeat>/<sample>/` in each worker's
    # workspace, kept); "shared": in the workers' own workspace (no `files` then)
    workspace: Literal["sample", "shared"] = "sample"


ScorerKind = Literal["exact", "includes", "regex", "number", "json_field", "python", "model"]


class Scorer(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    kind: ScorerKind
    name: str = ""  # "" = the kind
    ignore_case: bool = True  # exact, includes, regex
    pattern: str = ""  # regex: the pattern ("" = the target, as a pattern)
    tolerance: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # number: absolute
    field: str = ""  # json_field: a dotted path into the answer's JSON object
    fn: str = ""  # python: "module:function" (answer, sample) -> float | bool
    model: str = ""  # model: the grader's model alias ("": the gateway's default)
    template: str = ""  # model: the grading prompt ({input}, {answer}, {target}); "": DEFAULT

    @property
    def label(self) -> str:
        return self.name or self.kind


class Spec(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    dataset: DatasetSection
    variants: list[Variant]
    scorers: list[Scorer] = msgspec.field(default_factory=list)
    run: RunSection = msgspec.field(default_factory=RunSection)


class Sample(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    id: str | int
    input: str
    target: Any = None
    # copied into the cell's workspace: names next to the dataset (kept as they are), or
    # {name in the workspace: path next to the dataset}, as Inspect AI's `files`
    files: list[str] | dict[str, str] = msgspec.field(default_factory=list)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def key(self) -> str:
        return str(self.id)

    @property
    def placed(self) -> dict[str, str]:
        """Name in the workspace -> path relative to the dataset."""
        return dict(self.files) if isinstance(self.files, dict) else {f: f for f in self.files}


class Loaded(msgspec.Struct):
    """A checked spec with what it refers to: its samples and each variant's gateway overlay."""

    spec: Spec
    samples: list[Sample]
    source: str  # the spec file
    prompts: dict[str, str]  # variant -> its system prompt file's text (if any)
    dataset_dir: str = "."  # where the samples' `files` are

    def workspace(self, experiment: str, variant: Variant, sample: Sample,
                  repeat: int) -> RunWorkspace | None:
        """A cell's own workspace (`run.workspace = "sample"`): id
        `E/<variant>.r<repeat>/<sample>`, with its sample's files (read now)."""
        if self.spec.run.workspace != "sample":
            return None
        base = Path(self.dataset_dir)
        # checked again as it is read: the folder may have changed since `load_spec`
        files = {name: dataset_file(base, path, f"sample {sample.key!r}: files.{name}").read_bytes()
                 for name, path in sample.placed.items()}
        return RunWorkspace(id=cell_folder(experiment, variant.name, repeat, sample.key),
                            files=files)

    def overrides(self, variant: Variant, repeat: int) -> dict[str, LiveOverrides]:
        """What the model calls of `variant`'s sessions in `repeat` change, by agent."""
        by_agent: dict[str, dict[str, Any]] = {}
        for name, value in variant.set.items():
            agent, _, key = name.rpartition(".")
            if key in replay.REQUEST_KEYS:
                by_agent.setdefault(agent or variant.agent, {})[key] = _typed(key, value)
        own = by_agent.setdefault(variant.agent, {})
        if variant.model:
            own["model"] = variant.model
        if variant.name in self.prompts:
            own["system_prompt"] = self.prompts[variant.name]
        if self.spec.run.seed is not None and "seed" not in own:
            own["seed"] = self.spec.run.seed + repeat - 1
        return {agent: msgspec.convert(values, LiveOverrides)
                for agent, values in by_agent.items() if values}

    def max_turns(self, variant: Variant) -> int:
        for key in replay.TURN_KEYS:
            if key in variant.set:
                return int(variant.set[key])
        return self.spec.run.max_turns or 0

    @property
    def planned(self) -> int:
        return len(self.samples) * len(self.spec.variants) * self.spec.run.repeats


def variant_model(variant: Variant) -> str:
    """The model alias a variant pins (`model`, or `set.model` for its own agent); "" = its
    agent's own."""
    return variant.model or str(variant.set.get("model") or
                                variant.set.get(f"{variant.agent}.model") or "")


DEFAULT_MODEL_KEY = "default"  # run.per_model's key for an agent that names no model


def _typed(key: str, value: Any) -> Any:
    return [value] if key == "stop" and isinstance(value, str) else value


def load_spec(path: Path | str, *, limit: int = 0) -> Loaded:
    """Read and check a spec and its dataset (the first `limit` samples when > 0)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        spec = msgspec.toml.decode(data, type=Spec)
    except msgspec.ValidationError as exc:
        raise SpecError(f"{path}: {spec_message(str(exc), Spec)}") from None
    except msgspec.DecodeError as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from None
    problems = check_spec(spec, path.parent)
    if problems:
        raise SpecError(f"{path}: {problems[0]}")
    base = path.parent
    samples = load_dataset(base / spec.dataset.path, limit=limit)
    if spec.run.workspace == "shared" and any(s.files for s in samples):
        raise SpecError(f"{path}: run.workspace: \"shared\" runs every sample in the tool "
                        f"workers' own workspace, where its `files` cannot go; use \"sample\" "
                        f"(the default)")
    prompts = {}
    for i, variant in enumerate(spec.variants):
        if variant.system_prompt_file:
            file = base / variant.system_prompt_file
            try:
                prompts[variant.name] = file.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise SpecError(f"{path}: variants[{i}].system_prompt_file: cannot read "
                                f"{str(file)!r}: {exc}") from None
    return Loaded(spec, samples, str(path), prompts,
                  str((base / spec.dataset.path).parent))


SPEC_HELP = "README.md, \"Experiments from a spec file\""


def spec_message(message: str, root: type, top: str = "the top level") -> str:
    """msgspec's `... - at `$.run.repeat`` as `run.repeat: ...`, saying what would do: an
    unknown key lists the keys its table (`top` at the top) takes, a value out of a fixed set
    lists the set."""
    match = re.match(r"(?s)(.*) - at `\$\.?(.*)`$", message)
    text, path = match.groups() if match else (message, "")
    unknown = re.match(r"Object contains unknown field `(.+)`", text)
    table = _type_at(root, path)
    if unknown and isinstance(table, type) and issubclass(table, msgspec.Struct):
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        keys = ", ".join(f.name for f in msgspec.structs.fields(table))
        name = re.sub(r"\[\d+\]$", "", path)
        where = top if not path else f"[[{name}]]" if name != path else f"[{path}]"
        return f"{key}: unknown key; {where} takes: {keys} ({SPEC_HELP})"
    bad = re.match(r"Invalid enum value (.+)", text)
    if bad and typing.get_origin(table) is Literal:
        values = ", ".join(map(str, typing.get_args(table)))
        return f"{path}: {bad.group(1)} is not one of the values it takes: {values}"
    return f"{path or '(top level)'}: {text}"


def _type_at(root: Any, path: str) -> Any:
    """The type a spec key path (`scorers[0].kind`) has in `root` (None: not known)."""
    kind: Any = root
    for part in filter(None, re.sub(r"\[\d+\]", "", path).split(".")):
        kind = _unwrap(kind)
        if not (isinstance(kind, type) and issubclass(kind, msgspec.Struct)):
            return None
        kind = typing.get_type_hints(kind, include_extras=True).get(part)
    return _unwrap(kind)


def _unwrap(kind: Any) -> Any:
    """`list[X]`, `X | None` and `Annotated[X, ...]` as X."""
    while True:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) in (list, typing.Annotated) or (
                typing.get_origin(kind) is not Literal and len(args) == 1):
            kind = args[0]
        else:
            return kind


def check_spec(spec: Spec, folder: Path | None = None) -> list[str]:
    """Cross-field checks msgspec cannot express; each problem names its key. `folder`: the
    spec's, where a `python` scorer's module is looked for first."""
    problems: list[str] = []
    if not re.fullmatch(NAME, spec.name):
        problems.append(f"name: {spec.name!r} must be letters, digits, _ or - (it names the "
                        f"experiment in the event log)")
    if not spec.variants:
        problems.append("variants: give at least one [[variants]] table (name, agent)")
    names = [v.name for v in spec.variants]
    for i, variant in enumerate(spec.variants):
        problems += _variant_problems(f"variants[{i}]", variant, names)
    for i, scorer in enumerate(spec.scorers):
        problems += _scorer_problems(f"scorers[{i}]", scorer, folder)
    labels = [s.label for s in spec.scorers]
    for label in sorted({x for x in labels if labels.count(x) > 1}):
        problems.append(f"scorers: two scorers are called {label!r}; give one a `name`")
    for alias, limit in spec.run.per_model.items():
        if not 1 <= limit <= 10_000:
            problems.append(f"run.per_model.{alias}: {limit} sessions at once; expected 1 to "
                            f"10000")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", alias):
            problems.append(f"run.per_model.{alias}: a model alias (letters, digits, _ . -), as "
                            f"in the topology's [models.ALIAS]; `default` for the gateway's "
                            f"default model")
    overlays = len(spec.variants) * spec.run.repeats
    if overlays > MAX_OVERLAYS and (spec.run.seed is not None or any(
            v.set or v.model or v.system_prompt_file for v in spec.variants)):
        problems.append(f"variants / run.repeats: {overlays} variant × repeat cells change model "
                        f"settings, but a gateway holds {MAX_OVERLAYS} at once; use fewer "
                        f"repeats or variants, or drop run.seed")
    return problems


def _variant_problems(where: str, variant: Variant, names: list[str]) -> list[str]:
    problems: list[str] = []
    if not re.fullmatch(NAME, variant.name):
        problems.append(f"{where}.name: {variant.name!r} must be letters, digits, _ or -")
    elif names.count(variant.name) > 1:
        problems.append(f"{where}.name: variant {variant.name!r} is defined twice")
    if not variant.agent:
        problems.append(f"{where}.agent: name the agent (or a team's prompted agent) to run")
    if variant.tools is not None:
        problems.append(f"{where}.tools: an agent's tools are fixed where it is hosted; define "
                        f"another [[agents]] entry with these tools in the topology and name it "
                        f"in {where}.agent")
    for name, value in variant.set.items():
        problems += _setting_problems(f"{where}.set.{name}", variant, name, value)
    return problems


def _setting_problems(where: str, variant: Variant, name: str, value: Any) -> list[str]:
    """One `set` entry, checked with the ranges `busctl replay --set` uses."""
    agent, _, key = name.rpartition(".")
    if key not in replay.SETTABLE:
        return [f"{where}: unknown key `{key}`; a variant can set: {', '.join(replay.SETTABLE)}"]
    if key in replay.TURN_KEYS:
        if agent and agent != variant.agent:
            return [f"{where}: `{key}` bounds the prompted agent's runs only (`{variant.agent}`)"]
        try:
            msgspec.convert(value, TurnBound)
        except msgspec.ValidationError:
            return [f"{where}: expected a whole number of turns from 1 to {2**31 - 1}"]
        return []
    try:
        msgspec.convert({key: _typed(key, value)}, LiveOverrides)
    except msgspec.ValidationError as exc:
        reason = str(exc).partition(" - at ")[0]
        if "got `" in reason:
            reason = f"expected {replay.KINDS.get(key, 'a string')}"
        return [f"{where}: {reason}; e.g. {key} = {replay.EXAMPLES[key]}"]
    return []


class ScorerError(AgentBusError):
    pass


def load_function(ref: str, folder: Path | None = None) -> Callable[..., Any]:
    """A python scorer's `fn` ("module:function"), its module looked for next to the spec
    (`folder`), then in the current directory, then on the path (PYTHONPATH, installed
    packages): a scorer file kept with its spec needs no PYTHONPATH. Here, below
    agents/experiment/scoring.py (which calls it), because checking a spec resolves it too."""
    module, colon, name = ref.partition(":")
    if not colon or not module or not name:
        raise ScorerError(f"{ref!r}: expected \"module:function\", e.g. \"my_scorers:grade\"")
    near = [d for d in dict.fromkeys([folder, Path.cwd()]) if d is not None]
    try:
        with _searched(near, module):
            found = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        places = ", ".join(str(d.resolve()) for d in near)
        raise ScorerError(f"{ref!r}: cannot import module `{module}` ({exc}); looked for "
                          f"{module.split('.')[0]}.py next to the spec and in the current "
                          f"directory ({places}), then on PYTHONPATH") from None
    except AttributeError:
        raise ScorerError(f"{ref!r}: module `{module}` has no `{name}`") from None
    if not callable(found):
        raise ScorerError(f"{ref!r}: `{name}` is not a function")
    return found  # type: ignore[no-any-return]


@contextmanager
def _searched(folders: Sequence[Path], module: str) -> Iterator[None]:
    """The first of `folders` that has `module`'s top-level file or package on sys.path
    first while it is imported (only then: a folder's other files shadow nothing after)."""
    top = module.split(".")[0]
    found = next((str(d.resolve()) for d in folders
                  if (d / f"{top}.py").is_file() or (d / top / "__init__.py").is_file()), None)
    if found is None or top in sys.modules:
        yield
        return
    sys.path.insert(0, found)
    try:
        yield
    finally:
        sys.path.remove(found)


def _scorer_problems(where: str, scorer: Scorer, folder: Path | None = None) -> list[str]:
    if scorer.kind == "model" and scorer.template:
        try:
            scorer.template.format(input="", answer="", target="")
        except (KeyError, IndexError, ValueError) as exc:
            return [f"{where}.template: {exc!r}: the template may use {{input}}, {{answer}} "
                    f"and {{target}} (double other braces: {{{{ }}}})"]
    if scorer.kind == "json_field" and not scorer.field:
        return [f"{where}.field: json_field needs the dotted path of the field to compare"]
    if scorer.kind == "regex" and scorer.pattern:
        try:
            re.compile(scorer.pattern)
        except re.error as exc:
            return [f"{where}.pattern: not a regular expression: {exc}"]
    if scorer.kind == "python":
        try:
            load_function(scorer.fn, folder)
        except ScorerError as exc:
            return [f"{where}.fn: {exc}"]
    return []


def load_dataset(path: Path, *, limit: int = 0) -> list[Sample]:
    """The samples of a JSONL file; every problem names the file, the line and the key."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise SpecError(f"dataset.path: cannot read {str(path)!r}: {exc.strerror}") from None
    samples: list[Sample] = []
    seen: dict[str, int] = {}
    decoder = msgspec.json.Decoder(Sample)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        if len(line) > MAX_SAMPLE_BYTES:
            raise SpecError(f"{where}: a line of {len(line)} bytes (at most {MAX_SAMPLE_BYTES})")
        try:
            sample = decoder.decode(line)
        except msgspec.ValidationError as exc:
            raise SpecError(f"{where}: {spec_message(str(exc), Sample, 'a sample')}") from None
        except msgspec.DecodeError as exc:
            raise SpecError(f"{where}: not a JSON object: {exc}") from None
        if sample.key in seen:
            raise SpecError(f"{where}: id: {sample.key!r} is also the id on line "
                            f"{seen[sample.key]}; ids must be unique")
        if not sample.key or len(sample.key) > 200:
            raise SpecError(f"{where}: id: give a non-empty id of at most 200 characters")
        seen[sample.key] = number
        _check_files(where, path.parent, sample)
        samples.append(sample)
        if limit and len(samples) >= limit:
            break
    if not samples:
        raise SpecError(f"{path}: no samples (one JSON object a line: id, input, target, files, "
                        f"metadata)")
    return samples


def _check_files(where: str, base: Path, sample: Sample) -> None:
    """A sample's `files` exist, have names a workspace takes, and fit its limit in all."""
    size = 0
    for j, (name, source) in enumerate(sample.placed.items()):
        key = f"files[{j}]" if isinstance(sample.files, list) else f"files.{name}"
        file = dataset_file(base, source, f"{where}: sample {sample.key!r}: {key}")
        if not file.is_file():
            raise SpecError(f"{where}: {key}: no file {source!r} next to the dataset")
        problem = workspace_problem(RunWorkspace(id="x", files={name: b""}))
        if problem:
            raise SpecError(f"{where}: {key}: {problem.partition(': ')[2]}")
        size += len(name) + file.stat().st_size
    if size > MAX_WORKSPACE_BYTES:
        raise SpecError(f"{where}: files: {size} bytes in all, names included (at most "
                        f"{MAX_WORKSPACE_BYTES}: a sample's files go with every tool call of "
                        f"its session); keep big data in the tool workers' workspace and give "
                        f"the sample its name instead")


def dataset_file(base: Path, source: str, where: str) -> Path:
    """`source` (a sample's `files` entry) under the dataset's folder `base`, resolved; a
    SpecError naming `where` when it is absolute, has a `..` or resolves (through a symlink)
    outside the folder. Datasets are often third-party: a path out of the folder would copy
    any file of the user (a key) into the cell, where the model reads it."""
    path = PurePosixPath(source)
    folder = base.resolve()
    resolved = (folder / path).resolve()
    why = ""
    if path.is_absolute() or Path(source).is_absolute():
        why = "is an absolute path"
    elif ".." in path.parts:
        why = "goes up with `..`"
    elif not resolved.is_relative_to(folder):
        why = f"leads through a symlink to {str(resolved)!r}"
    if why:
        raise SpecError(f"{where}: {source!r} {why}; a sample's files must be inside the "
                        f"dataset's folder ({folder}): copy the file there and give its path "
                        f"relative to that folder")
    return resolved  # what was checked is what is read


def cell_folder(experiment: str, variant: str, repeat: int, sample: str) -> str:
    """A cell's workspace id, `E/<variant>.r<repeat>/<sample>`."""
    return "/".join(map(_segment, (experiment, f"{variant}.r{repeat}", sample)))


def _segment(name: str) -> str:
    """`name` as one segment of a workspace id: as it is when it can be, else its safe
    characters and a short hash (so two names never share one)."""
    import hashlib
    if "/" not in name and not workspace_problem(RunWorkspace(id=name)):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return "_" + re.sub(r"[^A-Za-z0-9_.=+,@-]", "_", name)[:100] + f"-{digest}"


def summary(loaded: Loaded) -> dict[str, Any]:
    """What `busctl experiment check` prints."""
    spec = loaded.spec
    return {"name": spec.name, "samples": len(loaded.samples),
            "variants": [v.name for v in spec.variants], "repeats": spec.run.repeats,
            "sessions": loaded.planned, "concurrency": spec.run.concurrency,
            **({"per_model": spec.run.per_model} if spec.run.per_model else {}),
            "scorers": [s.label for s in spec.scorers]}


def experiment_tag(experiment: str, variant: str, repeat: int) -> str:
    """The experiment id a cell's sessions carry: `E.<variant>.r<repeat>`."""
    return experiments.cell_tag(experiment, variant, repeat)


def spec_digest(loaded: Loaded) -> str:
    """Identifies what a run planned: `--resume` refuses a spec or dataset that changed."""
    import hashlib
    body = json.dumps([msgspec.to_builtins(loaded.spec), msgspec.to_builtins(loaded.samples),
                       loaded.prompts], sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]
