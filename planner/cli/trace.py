"""``moeplan trace info|synth|ingest``."""

from __future__ import annotations

import json

import typer

from planner.cli.app import console, trace_app
from planner.trace.info import trace_summary


@trace_app.command("info")
def info(
    path: str = typer.Argument(..., help="Trace file or directory of part-*.parquet files."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Model, layers, experts, top-k, tokens, requests and per-layer load skewness of a trace."""
    summary = trace_summary(path)
    if as_json:
        console.print_json(json.dumps(summary))
        return
    from planner.trace.info import render_summary

    console.print(render_summary(summary))
