"""The one configuration system every job uses.

A job describes its settings as a tree of dataclasses and calls :func:`parse_config`.
Values are layered: dataclass defaults < YAML files given with ``--config`` (in order,
later files win) < ``--section.option VALUE`` overrides. The type annotations are the
schema, so there is nothing else to keep in sync, and every failure names the key, the
expected type and where the bad value came from: a typo in a multi-node launch should
cost seconds at start-up, not a queued job that dies an hour later.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import re
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import (
    Any,
    Literal,
    Sequence,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

import yaml

from pipeline.core.errors import ConfigError

__all__ = [
    "ConfigError",
    "Renamed",
    "truthy",
    "parse_config",
    "describe",
    "Option",
    "check_inputs",
    "from_dict",
    "to_dict",
    "dump_yaml",
    "redact",
]

T = TypeVar("T")
_MISSING = dataclasses.MISSING
_NONE_TYPE = type(None)
_TRUE, _FALSE = {"true", "1", "yes", "y", "on"}, {"false", "0", "no", "n", "off"}
_NONE = {"none", "null", "~"}
_SECRET_PARTS = ("secret", "password", "access_key", "credential")
_EPILOG = """\
precedence: dataclass defaults < --config files (in order) < command-line options.
syntax: --a.b VALUE or --a.b=VALUE; booleans also --a.b / --no-a.b; optional values
accept none; lists are comma-separated (--ranks 0,1); dicts take a JSON object."""


@dataclasses.dataclass(frozen=True)
class Renamed:
    """A key a section used to have, still read from YAML files and the command line: as
    ``to`` (a dotted path inside the same section), its value mapped by ``convert`` (given
    the raw value: a YAML scalar or a command-line string). ``flag``: the old key was a
    boolean, so ``--old`` alone means true. A section lists them in a ``RENAMED`` class
    attribute; each use prints one note naming the new key."""

    to: str
    convert: Any = None  # Callable[[Any], Any]
    flag: bool = False


def truthy(value: Any) -> bool:
    """A YAML or command-line boolean; anything else is a ValueError (a user error)."""
    if isinstance(value, bool) or str(value).lower() in _TRUE | _FALSE:
        return value is True or str(value).lower() in _TRUE
    raise ValueError(f"expected true or false, got {value!r}")


def _renamed_value(rule: Renamed, value: Any, key: str) -> Any:
    try:
        return rule.convert(value) if rule.convert else value
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _renames(cls, prefix: str = "", out: dict | None = None) -> dict[str, tuple[str, Renamed]]:
    """Every renamed key of the tree, by its old dotted path: (new dotted path, rule)."""
    out = {} if out is None else out
    for old, rule in getattr(cls, "RENAMED", {}).items():
        out[prefix + old] = (prefix + rule.to, rule)
    for f, tp in _fields(cls):
        if _is_section(tp):
            _renames(tp, f"{prefix}{f.name}.", out)
    return out


def _note_renamed(old: str, new: str) -> None:
    print(f"note: {old} is now {new}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class _Leaf:
    tp: Any
    default: Any
    help: str
    section: str  # dotted path of the owning dataclass; "" for top level


def _fields(cls) -> list[tuple[dataclasses.Field, Any]]:
    """Resolved annotations, so job modules may use ``from __future__ import annotations``."""
    hints = get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _field_default(f: dataclasses.Field) -> Any:
    """A fresh default per call, so parse calls never share mutable instances."""
    if f.default_factory is not _MISSING:
        return f.default_factory()
    return _MISSING if f.default is _MISSING else copy.deepcopy(f.default)


def _check_type(tp: Any, path: str) -> None:
    """Fail at start-up on annotations we cannot convert, not when someone first overrides one."""
    origin, args = get_origin(tp), get_args(tp)
    if tp in (int, float, str, bool, list, dict, Any) or origin is Literal or _is_section(tp):
        return
    if origin in (Union, types.UnionType, list, dict):
        for arg in args:
            if arg is not _NONE_TYPE:
                _check_type(arg, path)
        return
    raise TypeError(f"config field '{path}': unsupported type {tp!r}")


def _schema(cls, prefix: str = "", base: Any = None, leaves=None, sections=None):
    """Flatten the tree into dotted options. Defaults are read from the parent's default
    instance, so a ``default_factory`` that customises a section shows its real values."""
    leaves = {} if leaves is None else leaves
    sections = {"": ""} if sections is None else sections
    for f, tp in _fields(cls):
        path = prefix + f.name
        default = getattr(base, f.name) if base is not None else _field_default(f)
        if _is_section(tp):
            sections[path] = f.metadata.get("help", "")
            _schema(tp, path + ".", None if default is _MISSING else default, leaves, sections)
        else:
            _check_type(tp, path)
            leaves[path] = _Leaf(tp, default, f.metadata.get("help", ""), prefix[:-1])
    if not prefix and "config" in leaves:
        raise TypeError("a top-level field may not be called 'config': --config loads YAML files")
    return leaves, sections


def _tname(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_tname(a) for a in args)
    if origin is Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_tname(a) for a in args)}]"
    return "None" if tp is _NONE_TYPE else getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str, source: str, cli: bool = False) -> Any:
    """Coerce one value to ``tp``. CLI values arrive as strings; YAML values are partly typed
    (PyYAML reads ``1e-4`` as a string), so strings are parsed for every scalar type."""

    where = f"invalid value for '{key}' from {source}"

    def bad() -> ConfigError:
        return ConfigError(f"{where}: expected {_tname(tp)}, got {value!r}")

    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None or (cli and isinstance(value, str) and value.lower() in _NONE):
            if _NONE_TYPE in args:
                return None
            raise bad()
        for arg in (a for a in args if a is not _NONE_TYPE):
            try:
                return _convert(value, arg, key, source, cli)
            except ConfigError:
                pass
        raise bad()
    if origin is Literal:
        for choice in args:
            if (value == choice and type(value) is type(choice)) or (isinstance(value, str) and value == str(choice)):
                return choice
        allowed = ", ".join(repr(a) for a in args)
        raise ConfigError(f"{where}: {value!r} is not one of {allowed}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower() if isinstance(value, (str, int)) else None
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise bad()
    if tp in (int, float) and not isinstance(value, bool):  # bool is an int; `lr: true` is a typo
        if isinstance(value, int) or (tp is float and isinstance(value, float)):
            return tp(value)
        if isinstance(value, str):
            return _attempt(tp, value.strip(), bad)
    if tp is str:
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return str(value)  # ints are lossless (`run_name: 2024`); floats/bools are not
        raise bad()
    if tp is list or origin is list:
        (elem,) = args or (Any,)
        if cli and isinstance(value, str):
            value = [v.strip() for v in value.split(",")] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise bad()
        return [_convert(v, elem, f"{key}[{i}]", source, cli) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if cli and isinstance(value, str):
            value = _attempt(json.loads, value, bad)
        if not isinstance(value, Mapping):
            raise bad()
        kt, vt = args or (Any, Any)
        return {_convert(k, kt, key, source): _convert(v, vt, f"{key}.{k}", source) for k, v in value.items()}
    if _is_section(tp) and isinstance(value, Mapping):  # e.g. list[Dataclass] from YAML
        return _from_mapping(tp, value, source, key + ".")
    raise bad()


def _attempt(fn, value: Any, bad) -> Any:
    try:
        return fn(value)
    except ValueError:  # includes json.JSONDecodeError
        raise bad() from None


def _suggest(name: str, candidates, shown: str = "") -> str:
    """'; did you mean ...?' for typos, and for a bare name that lives in a section."""
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    close += [c for c in candidates if c.endswith("." + name) and c not in close]
    return f"; did you mean {' or '.join(repr(shown + c) for c in close[:3])}?" if close else ""


def _overlay(cls, data: Any, into: dict, sources: dict, source: str, prefix: str = "") -> None:
    """Deep-merge one layer into ``into`` (sections merge, values replace), rejecting unknown
    keys while we still know which file they came from."""
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        data = to_dict(data)
    if not isinstance(data, Mapping):
        what = f"section '{prefix[:-1]}'" if prefix else "the configuration"
        raise ConfigError(f"{what} in {source} must be a mapping, got {data!r}")
    known = {f.name: tp for f, tp in _fields(cls)}
    renamed = getattr(cls, "RENAMED", {})
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in known and key in renamed:
            rule = renamed[key]
            _note_renamed(f"'{path}' in {source}", f"'{prefix}{rule.to}'")
            value = _renamed_value(rule, value, f"'{path}' in {source}")
            for part in reversed(rule.to.split(".")):
                value = {part: value}
            _overlay(cls, value, into, sources, source, prefix)
            continue
        if key not in known:
            hint = _suggest(str(key), known, prefix)
            raise ConfigError(f"unknown key '{path}' in {source}{hint}")
        if _is_section(known[key]):
            value = {} if value is None else value
            _overlay(known[key], value, into.setdefault(key, {}), sources, source, path + ".")
        else:
            into[key], sources[path] = value, source


def _build(cls: type[T], data: dict, sources: dict, prefix: str = "", base: Any = None) -> T:
    """Instantiate bottom-up. A section starts from its field's default instance (so a
    customised ``default_factory`` keeps its values), and ``__post_init__`` runs on the final
    values, so its ValueErrors become ConfigErrors naming the section."""
    kwargs = {}
    for f, tp in _fields(cls):
        path = prefix + f.name
        if _is_section(tp):
            sub = getattr(base, f.name) if base is not None else _field_default(f)
            sub = None if sub is _MISSING else sub
            kwargs[f.name] = _build(tp, data.get(f.name, {}), sources, path + ".", sub)
        elif f.name in data:
            kwargs[f.name] = _convert(data[f.name], tp, path, sources.get(path, "?"))
            _check_bounds(kwargs[f.name], f.metadata, path, sources.get(path, "?"))
        elif base is None and f.default is _MISSING and f.default_factory is _MISSING:
            raise ConfigError(f"missing required option '{path}'")
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        what = f"section {prefix[:-1]!r}" if prefix else "configuration"
        raise ConfigError(f"invalid {what}: {e}") from e


def _check_bounds(value: Any, metadata: Mapping, path: str, source: str) -> None:
    """A number outside the bounds its field declares (``min``, ``max``: inclusive;
    ``above``: exclusive) is refused as it is read, before any work, naming the option."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    bounds = {
        "min": (value < metadata.get("min", value), "at least"),
        "max": (value > metadata.get("max", value), "at most"),
    }
    if "above" in metadata:
        bounds["above"] = (value <= metadata["above"], "more than")
    for key, (outside, words) in bounds.items():
        if outside:
            raise ConfigError(f"invalid value for '{path}' from {source}: {value!r} must be {words} {metadata[key]:g}")


def _from_mapping(cls: type[T], data: Any, source: str, prefix: str = "") -> T:
    into: dict = {}
    sources: dict = {}
    _overlay(cls, data, into, sources, source, prefix)
    return _build(cls, into, sources, prefix)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error on one line: where (1-based line and column) and what."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(error, "context", None)
    return f"{where}{problem}" + (f" ({context})" if context else "")


def _load_yaml(path: str) -> Any:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}", source=str(path)) from None
    if data is None:  # an empty file overrides nothing
        return {}
    if not isinstance(data, Mapping):
        got = type(data).__name__
        raise ConfigError(f"config file {path} must hold a mapping at the top level, got {got}")
    return data


def _parse_argv(args: list[str], leaves: dict, sections: dict, renames: dict | None = None):
    """Our own override parser: argparse wants a flat namespace and its own type conversion,
    which cannot express nested Optional/list/Literal fields or YAML layering."""
    renames = renames or {}
    files, overrides, i = [], [], 0
    while i < len(args):
        tok = args[i]
        i += 1
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(f"unexpected argument {tok!r}; options look like --section.key VALUE")
        name, has_eq, value = tok[2:].partition("=")
        negate = not has_eq and name.startswith("no-") and name not in leaves
        name = name[3:] if negate else name
        if name not in leaves and name != "config":
            name = name.replace("-", "_")  # --train.warmup-steps works too
        if name == "config" and not negate:
            if not has_eq:
                if i >= len(args):
                    raise ConfigError("--config expects a YAML file path")
                value, i = args[i], i + 1
            files.append(value)
            continue
        if name not in leaves and name.replace("-", "_") in renames and not negate:
            name, rule = renames[name.replace("-", "_")]
            _note_renamed(tok.partition("=")[0], f"--{name}")
            if not has_eq:
                if i < len(args) and not args[i].startswith("--"):
                    value, i = args[i], i + 1
                elif rule.flag:
                    value = "true"
                else:
                    raise ConfigError(f"option {tok} expects a value")
            value = _renamed_value(rule, value, tok.partition("=")[0])
            source = f"the command line ({tok.partition('=')[0]})"
            overrides.append((name, _convert(value, leaves[name].tp, name, source, cli=True), source))
            continue
        leaf = leaves.get(name)
        if leaf is None:
            if name in sections:
                raise ConfigError(f"--{name} is a section; set its fields, e.g. --{name}.<field>")
            hint = _suggest(name, leaves, "--")
            raise ConfigError(f"unknown option {tok.partition('=')[0]}{hint}")
        is_bool = leaf.tp is bool or bool in get_args(leaf.tp)
        if negate:
            if not is_bool:
                raise ConfigError(f"--no-{name}: --{name} is {_tname(leaf.tp)}, not a boolean")
            value = "false"
        elif not has_eq:
            if i < len(args) and not args[i].startswith("--"):
                value, i = args[i], i + 1
            elif is_bool:
                value = "true"
            else:
                raise ConfigError(f"option --{name} expects a value ({_tname(leaf.tp)})")
        source = f"the command line (--{name})"
        overrides.append((name, _convert(value, leaf.tp, name, source, cli=True), source))
    return files, overrides


def _fmt(value: Any) -> str:
    """Defaults in the same syntax the CLI accepts, so they can be copied."""
    if value is _MISSING:
        return "required"
    if value is None or isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(map(_fmt, value)) or "[]"
    if isinstance(value, dict):
        return json.dumps(value, default=str)
    return str(value) if value != "" else "''"


@dataclasses.dataclass(frozen=True)
class Option:
    """One option as ``--help`` and the options reference (docs/reference/) show it."""

    path: str  # dotted: train.num_workers
    type: str
    default: str  # in the syntax the command line accepts
    help: str
    section: str  # the dotted section it belongs to ("" at the top)


def describe(cls) -> tuple[list[Option], dict[str, str]]:
    """Every option of ``cls`` (a job's config), and each section's description."""
    leaves, sections = _schema(cls)
    options = []
    for path, leaf in leaves.items():
        default = _fmt(leaf.default)
        if _is_secret(path.rsplit(".", 1)[-1]) and default not in ("none", "required"):
            default = "***"  # a default read from the environment must not reach logs
        options.append(Option(path, _tname(leaf.tp), default, leaf.help, leaf.section))
    return options, sections


def _help_parser(cls, description: str | None, prog: str | None):
    """argparse only renders help here; it never sees the real arguments."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [--config FILE ...] [--section.option VALUE ...]",  # not 100 options
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file; repeat to layer, later wins")
    options, sections = describe(cls)
    groups: dict[str, Any] = {"": parser}
    for path, text in sections.items():
        if path:
            groups[path] = parser.add_argument_group(f"[{path}]", text.replace("%", "%%") or None)
    for option in options:
        text = f"{option.help} (default: {option.default})" if option.help else f"(default: {option.default})"
        groups[option.section].add_argument(f"--{option.path}", metavar=option.type, help=text.replace("%", "%%"))
    return parser


def parse_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    description: str | None = None,
    *,
    prog: str | None = None,
    exit_on_error: bool | None = None,
) -> T:
    """Resolve ``cls`` from defaults, ``--config`` YAML files and CLI overrides.

    ``exit_on_error`` defaults to ``argv is None``: a job reading ``sys.argv`` behaves like
    argparse (``error: ...`` on stderr, exit 2), while callers and tests passing ``argv``
    get a ``ConfigError`` they can inspect. ``--help`` always prints and exits 0.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    exit_on_error = argv is None if exit_on_error is None else exit_on_error
    leaves, sections = _schema(cls)
    if "-h" in args or "--help" in args:
        _help_parser(cls, description, prog).print_help()
        raise SystemExit(0)
    try:
        renames = _renames(cls)
        for old, (new, _) in renames.items():
            if new not in leaves:
                raise TypeError(f"{cls.__name__}: {old} is renamed to {new}, which is not an option")
        files, overrides = _parse_argv(args, leaves, sections, renames)
        data: dict = {}
        sources: dict = {}
        for path in files:
            _overlay(cls, _load_yaml(path), data, sources, f"config file '{path}'")
        for path, value, source in overrides:
            for part in reversed(path.split(".")):
                value = {part: value}
            _overlay(cls, value, data, sources, source)
        return _build(cls, data, sources)
    except ConfigError as e:
        if not exit_on_error:
            raise
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def from_dict(cls: type[T], data: Mapping[str, Any], *, source: str = "dict") -> T:
    """Build ``cls`` from a nested mapping (e.g. a saved run config) with a YAML file's checks."""
    _schema(cls)
    return _from_mapping(cls, data, source)


def to_dict(cfg: Any) -> Any:
    """Plain nested dicts/lists/scalars (no tuples or dataclasses), which ``yaml.safe_dump``
    and JSON accept; init=False fields are left out so the result feeds :func:`from_dict`.
    A config gives a dict; its values, whatever they are, their plain form."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


def dump_yaml(cfg: Any, *, redact_secrets: bool = True) -> str:
    """The resolved config as YAML, for saving next to a run's outputs. Secrets are redacted by
    default because these files get copied around; pass ``redact_secrets=False`` to reload one."""
    data = redact(to_dict(cfg)) if redact_secrets else to_dict(cfg)
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def _is_secret(key: Any) -> bool:
    """'token' only as the last word (api_token, hf_token) so that tokenizer, max_tokens and
    model keys like pad_token_id stay visible; camelCase counts as words (authToken)."""
    split = re.sub(r"([a-z0-9])([A-Z])|([A-Z])([A-Z][a-z])", r"\1\3_\2\4", str(key)).lower()
    words = [w for w in re.split(r"[^a-z0-9]+", split) if w]
    return any(part in "_".join(words) for part in _SECRET_PARTS) or words[-1:] == ["token"]


def redact(d: Any) -> Any:
    """A copy with secret-looking keys' values replaced by '***', recursively (also inside lists).
    None is kept: 'not set' leaks nothing and helps debugging."""
    if dataclasses.is_dataclass(d) and not isinstance(d, type):
        d = to_dict(d)
    if isinstance(d, Mapping):
        return {k: "***" if _is_secret(k) and v is not None else redact(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [redact(v) for v in d]
    return d


def check_inputs(cfg: Any, prefix: str = "--") -> None:
    """Each section's cheap checks, outer sections first: a section may define
    ``check_inputs(self, prefix)`` (``prefix``: its options' spelling, ``--corpus.``) to
    refuse what it can see is wrong without Ray: a file that is not there, a model reference
    that does not resolve, a name that is not one. A job runs them before Ray starts.

    What a run does not use is not checked: a section whose ``enabled`` is false, and the
    sections a ``check_inputs`` returns the names of (the recipe's ``model`` while it
    pre-trains its own)."""
    own = getattr(cfg, "check_inputs", None)
    unused = set((own(prefix) if callable(own) else None) or ())
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(value) or isinstance(value, type) or f.name in unused:
            continue
        if getattr(value, "enabled", True) is False:
            continue
        check_inputs(value, f"{prefix}{f.name}.")
