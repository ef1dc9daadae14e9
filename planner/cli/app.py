"""The typer applications every command module registers on, and shared option helpers."""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console

app = typer.Typer(
    name="moeplan",
    help="Plan expert placement and token routing for expert-parallel MoE serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
trace_app = typer.Typer(
    help="Inspect, synthesise and ingest routing traces.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(trace_app, name="trace")


@app.callback()
def _root(
    ctx: typer.Context,
    config: str = typer.Option(
        None,
        "--config",
        help="TOML file with one table per command ([solve], [trace.split], ...) whose keys "
        "set that command's options; the command line wins over the file.",
    ),
) -> None:
    """Plan expert placement and token routing for expert-parallel MoE serving."""
    if config is not None:  # "" is refused (it was ignored, the options then missing)
        from planner.cli.config import load_config

        ctx.default_map = load_config(config, ctx.command)


# Summaries go to stdout; progress bars and warnings to stderr.
# Piped output (CI logs, `| tee`) gets a wide fixed width instead of rich's 80 columns, so
# tables are not truncated. No console markup: what is printed holds users' paths and model
# names, and "runs[v2]/t" must print as it is, not lose "[v2]" or fail as bad markup.
# Colour goes through Text styles instead.
console = Console(markup=False) if Console().is_terminal else Console(width=160, markup=False)
err_console = Console(stderr=True, markup=False)


def print_json(obj: object) -> None:
    """``--json`` output: plain JSON on stdout, never coloured (rich's print_json colours it
    whenever FORCE_COLOR is set, as CI jobs often do, even into a pipe)."""
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
    sys.stdout.flush()


def comma_names(text: str) -> list[str]:
    """The names of a comma-separated option, each once, in order, blanks dropped
    ("ceo, metis,,ceo" -> ["ceo", "metis"])."""
    return list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))


def refuse_empty_paths(
    arguments: dict[str, str | list[str] | None] | None = None, **options: str | None
) -> None:
    """InputError for a path given as "": ``Path("")`` is ".", the folder the command runs
    in, so an empty ``--out`` was written into it, or refused for another reason than the
    real one, an empty ``--plot`` drew nothing without a word, and an empty input (``evaluate
    PLAN HELDOUT --against ''``, ``solve --align-to ''``) read the folder the command ran in,
    as a plan or a trace, where it was one.

    ``arguments``: the command's positional paths by name (a list: each of its paths), named
    as its usage line shows them (``{heldout}``); ``options``: its path options by name."""
    from planner.errors import InputError

    for name, value in (arguments or {}).items():
        if value == "" or (isinstance(value, list) and "" in value):
            raise InputError(f"{{{name}}} is empty; give a path")
    for name, value in options.items():
        if value == "":
            raise InputError(f"--{name.replace('_', '-')} is empty; give a path")


def typed(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given on the command line (not by a --config file's table
    or its default). Compared by name: typer may carry its own copy of click's
    ParameterSource."""
    return getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"
