"""Read the prompts a model is profiled on.

Two formats, chosen per file:

* JSONL (the file ends in ``.jsonl``/``.json``, or in neither that nor ``.txt`` and its
  first non-empty line starts with ``{``): one object per line, ``{"text": str, "id"?: str |
  int, "domain"?: str}``.
* Plain text: every non-blank line is one prompt (a ``.txt`` file always, so a code prompt
  may open with ``{``).

Blank lines are skipped in both. A prompt's ``index`` is its position among the prompts
(0-based, blank lines not counted); the profiler uses it as the trace's ``request_id`` so
that a resumed run maps each prompt to the same id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from planner.errors import InputError

JSONL_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt",)


@dataclass(frozen=True)
class Prompt:
    """One prompt.

    Attributes:
        index: 0-based position among the file's prompts; becomes the trace's request_id.
        id: the JSONL ``id`` (as a string), else ``str(index)``.
        text: the prompt text (non-empty).
        domain: the JSONL ``domain``, or None.
    """

    index: int
    id: str
    text: str
    domain: str | None = None


def read_prompts(path: str | Path) -> list[Prompt]:
    """Parse a JSONL or plain-text prompts file; raise :class:`InputError` naming the bad line."""
    path = Path(path)
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise InputError(f"prompts file {str(path)!r} {what} (pass --prompts FILE)")
    lines = _decoded_lines(path)
    first = next((line for _, line in lines if line.strip()), None)
    if first is None:
        raise InputError(f"{path}: no prompts (the file is empty or blank)")
    suffix = path.suffix.lower()
    is_jsonl = suffix in JSONL_SUFFIXES or (
        suffix not in TEXT_SUFFIXES and first.lstrip().startswith("{")
    )
    prompts: list[Prompt] = []
    for lineno, line in lines:
        if not line.strip():
            continue
        if is_jsonl:
            prompts.append(_parse_json_line(path, lineno, line, len(prompts)))
        else:
            prompts.append(Prompt(len(prompts), str(len(prompts)), line))
    return prompts


def _decoded_lines(path: Path) -> list[tuple[int, str]]:
    """[(1-based line number, text without its line ending)]."""
    out = []
    for lineno, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{path}:{lineno}: not valid UTF-8 ({e.reason})") from None
        out.append((lineno, text.removeprefix("\ufeff") if lineno == 1 else text))
    return out


def _parse_json_line(path: Path, lineno: int, line: str, index: int) -> Prompt:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise InputError(f"{where}: invalid JSON ({e})") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise InputError(f"{where}: invalid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise InputError(
            f'{where}: expected a JSON object like {{"text": ...}}, got {type(obj).__name__}'
        )
    if "text" not in obj:
        raise InputError(f'{where}: missing "text" field')
    text = obj["text"]
    if not isinstance(text, str):
        raise InputError(f'{where}: "text" must be a string, got {type(text).__name__}')
    if not text.strip():
        raise InputError(f'{where}: "text" is empty')
    pid = obj.get("id", index)
    if isinstance(pid, bool) or not isinstance(pid, str | int):
        raise InputError(f'{where}: "id" must be a string or integer, got {pid!r}')
    domain = obj.get("domain")
    if domain is not None and not isinstance(domain, str):
        raise InputError(f'{where}: "domain" must be a string, got {domain!r}')
    for name, value in (("text", text), ("id", pid), ("domain", domain)):
        if isinstance(value, str):
            _check_no_surrogate(where, name, value)
    return Prompt(index, str(pid), text, domain)


def _check_no_surrogate(where: str, name: str, value: str) -> None:
    """Refuse a string that is not valid Unicode text: a JSON escape such as ``\\ud800``
    decodes to an unpaired UTF-16 surrogate, which no tokenizer or Parquet file accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(
            f'{where}: "{name}" holds an unpaired surrogate ({ascii(value[e.start])} at '
            f"character {e.start}); write the character itself or a valid surrogate pair"
        ) from None
