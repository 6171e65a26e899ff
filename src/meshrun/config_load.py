"""Loading the job configuration: defaults, then a TOML file, then ``--section.key=value`` overrides, each
string converted to its field's type; and the TOML text of a config.

Everything here is re-exported by :mod:`meshrun.config`; import it from there.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from meshrun.config_checks import ConfigError

if TYPE_CHECKING:
    from meshrun.config import JobConfig


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file, then ``section.key=value`` overrides; validated."""
    from meshrun.config import JobConfig  # the dataclasses import this module: imported when needed

    config = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"--config {path}: top-level key {section!r} must be a [section] table")
            for key, value in values.items():
                set_option(config, f"{section}.{key}", value)
    for item in overrides or []:
        key, sep, value = item.lstrip("-").partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        set_option(config, key, value)
    config.validate()
    return config


def join_overrides(rest: list[str], *, command: str, flags: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The ``--section.key=value`` items of a command line that its own parser left over, accepting ``--a.b c`` as
    ``--a.b=c``; anything else is refused naming ``command``'s help, and the closest of the command's own
    ``flags`` or config options where one is close."""
    overrides, i = [], 0
    while i < len(rest):
        item = rest[i]
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {item!r}{_close_flag(item, flags)}; options look like "
                              f"--section.key=value (see `{command} --help`)")
        if "=" not in item and i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            item, i = f"{item}={rest[i + 1]}", i + 1
        overrides.append(item)
        i += 1
    return overrides


def _close_flag(item: str, flags: list[str] | tuple[str, ...]) -> str:
    """' (did you mean --fresh?)' for a mistyped flag of the command, or ' (did you mean --train.steps?)' for a
    config option without its section; '' when nothing is close."""
    import difflib

    from meshrun.config_help import option_names

    name = item.split("=", 1)[0]
    if not name.startswith("--"):
        return ""
    close = difflib.get_close_matches(name, list(flags), n=1, cutoff=0.75)
    if not close:
        key = name[2:].replace("-", "_")
        close = ["--" + n for n in option_names() if n.partition(".")[2] == key][:1]
    return f" (did you mean {close[0]}?)" if close else ""


def set_option(config: JobConfig, dotted: str, value: Any) -> None:
    """Set ``section.key`` on ``config``, converting strings to the field's type."""
    section_name, _, key = dotted.partition(".")
    sections = {f.name: f for f in dataclasses.fields(config)}
    hints = get_type_hints(type(getattr(config, section_name))) if section_name in sections else {}
    if key not in hints:
        from meshrun.config_help import suggest  # reads this module's classes: imported when needed

        raise ConfigError(f"unknown config option {dotted!r}{suggest(dotted)}"
                          + ("" if section_name in sections else f"; sections are {', '.join(sections)}"))
    setattr(getattr(config, section_name), key, _convert(dotted, value, hints[key]))


def _convert(option: str, value: Any, kind: Any) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{option}={value!r} is not a boolean; use true or false")
    if get_origin(kind) is dict:
        try:
            value = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{option}={value!r} is not a JSON object ({exc}); e.g. "
                              f"'{{\"endpoint_url\": \"http://127.0.0.1:9000\"}}'") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{option}={value!r} must be a table (TOML) or a JSON object")
        return dict(value)
    if kind in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{option}={value!r} must be a {kind.__name__}")
        try:
            return kind(value) if kind is float or isinstance(value, int) else int(str(value), 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{option}={value!r} is not a valid {kind.__name__}") from None
    return str(value)


def to_toml(config: Any) -> str:
    """The TOML text of a config: one ``[section]`` table per dataclass section."""
    lines = []
    for section, values in dataclasses.asdict(config).items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)
