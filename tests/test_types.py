"""The type check (STYLE habit 11): mypy over ``planner/`` with pyproject.toml's settings.

Runs when mypy is installed (``pip install -e '.[types]'``, which the README's test
command tries); skipped otherwise, e.g. on an offline mirror without mypy's wheels.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_planner_type_checks() -> None:
    api = pytest.importorskip(
        "mypy.api", reason="mypy is not installed (pip install -e '.[types]')"
    )
    config = str(ROOT / "pyproject.toml")
    cache = str(ROOT / ".mypy_cache")
    out, err, status = api.run(
        ["--config-file", config, "--cache-dir", cache, str(ROOT / "planner")]
    )
    assert status == 0, out + err
