"""Routing traces: schema v1, streaming reader, atomic writer, synthetic and engine sources."""

from planner.trace.io import Trace, TraceBatch, TraceWriter, open_trace, trace_parts, write_trace
from planner.trace.schema import SCHEMA_VERSION, CountsMeta, TraceMeta, arrow_schema

__all__ = [
    "SCHEMA_VERSION",
    "CountsMeta",
    "Trace",
    "TraceBatch",
    "TraceMeta",
    "TraceWriter",
    "arrow_schema",
    "open_trace",
    "trace_parts",
    "write_trace",
]
