"""The shared progress display: silent when disabled, plain timed lines off a terminal."""

from __future__ import annotations

from planner import _progress
from planner._progress import progress_bar


def test_disabled_prints_nothing(capsys):
    with progress_bar(False, "fitting", 10, unit="tokens") as advance:
        advance(5)
        advance(5, "detail")
    assert capsys.readouterr().err == ""


def test_short_work_off_a_terminal_prints_nothing(capsys):
    # pytest's captured stderr is not a terminal: the plain-line mode, here with no interval over
    with progress_bar(True, "fitting", 10, unit="tokens") as advance:
        for _ in range(10):
            advance()
    assert capsys.readouterr().err == ""


def test_long_work_off_a_terminal_prints_counted_lines_and_the_end(capsys, monkeypatch):
    clock = iter(float(t) for t in range(0, 1000, 20))  # every call 20 s later
    monkeypatch.setattr(_progress.time, "monotonic", lambda: next(clock))
    with progress_bar(True, "solve (ceo)", 4, unit="layers", log_every=30) as advance:
        for layer in range(4):
            advance(1, f"layer {layer}")
    lines = capsys.readouterr().err.splitlines()
    # start t=0; advances at 20, 40 (line), 60, 80 (line); the closing line at 100
    assert lines == [
        "solve (ceo): 2/4 layers (50%)  layer 1  40 s",
        "solve (ceo): 4/4 layers (100%)  layer 3  80 s",
        "solve (ceo): 4/4 layers (100%)  layer 3  100 s",
    ]


def test_an_error_inside_prints_no_closing_line(capsys, monkeypatch):
    clock = iter(float(t) for t in range(0, 1000, 40))
    monkeypatch.setattr(_progress.time, "monotonic", lambda: next(clock))
    try:
        with progress_bar(True, "evaluating", 8, log_every=30) as advance:
            advance(2)
            raise ValueError("stop")
    except ValueError:
        pass
    assert capsys.readouterr().err.splitlines() == ["evaluating: 2/8 (25%)  40 s"]
