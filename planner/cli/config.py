"""``moeplan --config FILE.toml``: any command's options from a TOML file.

One table per command, named as on the command line; keys are the options' long names
without the dashes (``ngram-routed`` for ``--ngram-routed``, ``json`` for ``--json``) or
the arguments' names (``predictor``)::

    [fit]
    holdout = 0.5
    ngram-routed = true

    [solve]
    method = "ceo"
    ep = 8
    jobs = 2
    options = { ceo = { effort = 7.5e6 } }   # the JSON of --options, as a TOML table

    [trace.split]
    holdout = 0.2

The values become the commands' defaults (click's ``default_map``), so an option given on
the command line wins over the file, and a required option (``--ep``) may come from the
file alone. Values go through the same parsing and checks as typed ones, and must have the
option's TOML type first (``ep = 4``, not ``"4"`` or ``true``; a flag takes true or false).
An unknown table or key is an error that lists the valid ones; a table value for an option that takes JSON
(``--options``) is passed as JSON, a list for a comma-separated option (``--methods``) is
joined with commas. A nightly job can then keep its whole pipeline in one reviewed file.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from planner.errors import InputError


def _exposed(command: Any) -> list[Any]:
    """The command's parameters a table may set (not ``--config`` itself)."""
    return [p for p in command.params if p.name and p.expose_value and p.name != "config"]


def _flags(param: Any) -> list[str]:
    """The parameter's long flags without their dashes (``json`` for ``--json``)."""
    return [f[2:] for f in getattr(param, "opts", []) if f.startswith("--")]


def _names(command: Any) -> dict[str, str]:
    """{name a table may use: parameter name}: each option's long flags without the dashes,
    and each parameter's own name with dashes or underscores."""
    names = {}
    for p in _exposed(command):
        names[p.name] = names[p.name.replace("_", "-")] = p.name
        names.update(dict.fromkeys(_flags(p), p.name))
    return names


def _shown(command: Any) -> list[str]:
    """The names an error lists: long flags without dashes, and the arguments."""
    return sorted({n for p in _exposed(command) for n in _flags(p) or [p.name.replace("_", "-")]})


def _kind(param: Any) -> type | None:
    """The Python type a parameter takes (int, float, bool or str; None: another)."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if annotation in (int, float, bool, str):
        return annotation
    name = str(getattr(getattr(param, "type", None), "name", ""))  # click's own types
    return {"integer": int, "float": float, "boolean": bool, "text": str}.get(name)


# What each kind of option takes from TOML, for the error message.
_WANTED = {int: "an integer", float: "a number", bool: "true or false"}


def _value(value: Any, param: Any, where: str, key: str) -> Any:
    """``value`` from the TOML table as the option takes it, or :class:`InputError`.

    TOML values are typed: a number option takes a number, not a string that click would
    parse (or a boolean, which Python counts as an integer: ``ep = true`` is not EP 1); a
    flag takes true or false.
    """
    kind = _kind(param)
    if kind in _WANTED:
        ok = isinstance(value, bool) if kind is bool else (
            isinstance(value, int if kind is int else int | float)
            and not isinstance(value, bool)
        )  # fmt: skip
        if not ok:
            raise InputError(f"{where}: {key} must be {_WANTED[kind]}, not {value!r}")
        return value
    # What a text option takes is in its help: a table only where it takes JSON (--options),
    # a list where it takes several values (trace ingest's dumps) or a comma-separated one
    # (--methods ceo,kmeans); anywhere else, "out = ['a', 'b']" wrote to "a,b".
    takes = str(getattr(param, "help", "") or "").lower()
    if isinstance(value, dict) and "json" in takes:
        try:
            return json.dumps(value)
        except (TypeError, ValueError):  # a TOML date or time inside it: a traceback
            raise InputError(
                f"{where}: {key} holds a value JSON cannot carry (a date or time?): {value!r}"
            ) from None
    if isinstance(value, str) and (
        getattr(param, "multiple", False) or getattr(param, "nargs", 1) == -1
    ):
        return [value]  # one path where several may go ("dumps = 'runs/dumps'")
    scalars = isinstance(value, list) and all(
        isinstance(v, str | int | float) and not isinstance(v, bool) for v in value
    )
    if scalars and (getattr(param, "multiple", False) or getattr(param, "nargs", 1) == -1):
        return [str(v) for v in value]
    if scalars and "comma" in takes:
        return ",".join(str(v) for v in value)
    if isinstance(value, bool) or not isinstance(value, str | int | float):  # a date, a flag
        raise InputError(f"{where}: {key} must be a string, not {value!r}")
    return value


def _defaults(table: dict[str, Any], command: Any, where: str) -> dict[str, Any]:
    """The ``default_map`` of ``command`` (a click command or group) from its TOML table."""
    subcommands = getattr(command, "commands", None)
    if subcommands is not None:  # a group: one table per subcommand
        out = {}
        for name, sub in table.items():
            if name not in subcommands:
                raise InputError(
                    f"{where}: [{name}] names no command here; "
                    f"tables: {', '.join(sorted(subcommands))}"
                )
            if not isinstance(sub, dict):
                raise InputError(f"{where}: {name} must be a table of its options, not {sub!r}")
            out[name] = _defaults(sub, subcommands[name], f"{where} [{name}]")
        return out
    names = _names(command)
    params = {p.name: p for p in _exposed(command)}
    out = {}
    for key, value in table.items():
        if key not in names:
            known = ", ".join(_shown(command))
            raise InputError(f"{where}: {key!r} is not an option here; options: {known}")
        out[names[key]] = _value(value, params[names[key]], where, key)
    return out


def load_config(path: str, root: Any) -> dict[str, Any]:
    """``default_map`` for the ``root`` group from the TOML file at ``path``."""
    if not path.strip():
        raise InputError("--config is empty; name a TOML file")
    file = Path(path)
    if file.is_dir():
        raise InputError(f"--config {path}: is a directory; name a TOML file")
    if not file.exists():
        raise InputError(f"--config {path}: no such file")
    if not file.is_file():
        raise InputError(f"--config {path}: is not a regular file; name a TOML file")
    try:
        table = tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"--config {path}: not valid TOML ({e})") from None
    except RecursionError:
        raise InputError(f"--config {path}: not valid TOML (nested too deeply)") from None
    except OSError as e:
        raise InputError(f"--config {path}: cannot be read ({e.strerror})") from None
    return _defaults(table, root, f"--config {path}")
