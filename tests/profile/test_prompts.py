"""Prompts files: JSONL and plain text, errors that name the line."""

from __future__ import annotations

import pytest

from planner.errors import InputError
from planner.profile.prompts import Prompt, read_prompts


def test_jsonl_with_ids_domains_and_blank_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"text": "hello world", "id": "a", "domain": "chat"}\n'
        "\n"
        '{"text": "def f(): pass", "id": 7}\n'
        "   \n"
        '{"text": "x = 1", "domain": "code"}\n'
    )
    assert read_prompts(path) == [
        Prompt(0, "a", "hello world", "chat"),
        Prompt(1, "7", "def f(): pass", None),
        Prompt(2, "2", "x = 1", "code"),
    ]


def test_plain_text_one_prompt_per_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\n  second, with {braces}\r\nthird")
    assert read_prompts(path) == [
        Prompt(0, "0", "first prompt"),
        Prompt(1, "1", "  second, with {braces}"),
        Prompt(2, "2", "third"),
    ]


def test_jsonl_detected_from_first_line_unless_the_name_says_text(tmp_path):
    for name in ("prompts", "p.data"):
        path = tmp_path / name
        path.write_text('\n  {"text": "a"}\n{"text": "b"}\n')
        assert [p.text for p in read_prompts(path)] == ["a", "b"]
    # a .txt file is plain text, whatever its first line: code prompts open with "{"
    path = tmp_path / "p.txt"
    path.write_text('{ "a": 1 }\nint main() {\n')
    assert [p.text for p in read_prompts(path)] == ['{ "a": 1 }', "int main() {"]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"text": "unterminated', "invalid JSON"),
        ('["text", "a list"]', "expected a JSON object"),
        ('{"id": 3}', 'missing "text"'),
        ('{"text": ""}', '"text" is empty'),
        ('{"text": "   "}', '"text" is empty'),
        ('{"text": 5}', '"text" must be a string'),
        ('{"text": "a", "id": [1]}', '"id" must be a string or integer'),
        ('{"text": "a", "id": true}', '"id" must be a string or integer'),
        ('{"text": "a", "domain": 3}', '"domain" must be a string'),
        ('{"text": "a \\ud800 b"}', '"text" holds an unpaired surrogate'),
        ('{"text": "ok", "id": "\\udfff"}', '"id" holds an unpaired surrogate'),
        ('{"text": "ok", "domain": "x\\ud83d"}', '"domain" holds an unpaired surrogate'),
    ],
)
def test_bad_jsonl_line_is_named(tmp_path, line, needle):
    # the first line's surrogate pair is valid: only lone halves are refused
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "ok \\ud83d\\ude00 pair"}\n\n' + line + "\n")
    with pytest.raises(InputError, match=needle) as info:
        read_prompts(path)
    assert f"{path}:3:" in str(info.value)


def test_invalid_utf8_is_named(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"fine\n\xff\xfe broken\n")
    with pytest.raises(InputError, match=r":2: not valid UTF-8"):
        read_prompts(path)


@pytest.mark.parametrize("content", ["", "\n\n   \n"])
def test_empty_file_is_an_error(tmp_path, content):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(InputError, match="no prompts"):
        read_prompts(path)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl")
