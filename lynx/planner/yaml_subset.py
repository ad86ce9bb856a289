"""The YAML that hardware files need, read and written without a YAML library.

Lynx's dependencies hold no YAML parser, and a hardware file is nested mappings of numbers
and names, so this reads exactly that subset: ``key: value`` lines nested by indentation
(spaces), ``# comments``, one-line flow mappings ``{alpha_s: 30e-6, beta_bytes_per_s: 2.9e9}``
and one-line flow lists ``[a, b]``, scalars as YAML 1.2 reads them (``true``/``false``,
``null``/``~``, integers, floats — ``25e9`` is a number here, as in YAML 1.2 and unlike PyYAML
— and plain or quoted strings). Anything else (block lists, anchors, multi-line strings, tabs)
is refused with the line it is on; such files can be written as JSON instead.

Example::

    >>> text = '''
    ... name: my-cluster   # a comment
    ... device: a100-80g
    ... links:
    ...   pp: {alpha_s: 30e-6, beta_bytes_per_s: 2.9e9}
    ...   dp:
    ...     alpha_s: 1e-3
    ...     beta_bytes_per_s: 1.17e8
    ... '''
    >>> data = loads(text, "my_cluster.yaml")
    >>> data["links"]["pp"]["beta_bytes_per_s"], data["links"]["dp"]["alpha_s"]
    (2900000000.0, 0.001)
    >>> loads(dumps(data), "again.yaml") == data
    True
"""

from __future__ import annotations

import json
import re
from typing import Any

from lynx.errors import LynxConfigError

__all__ = ["loads", "dumps"]

_INT = re.compile(r"[-+]?(0|[1-9][0-9_]*)")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?")
_SPECIAL_FLOATS = {".inf": float("inf"), "+.inf": float("inf"), "-.inf": float("-inf"), ".nan": float("nan")}


def loads(text: str, where: str) -> dict[str, Any]:
    """Parse ``text`` (the subset above) into a dict; errors name ``where`` and the line."""
    lines = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise _error(where, number, "indentation uses a tab; indent with spaces")
        content = _strip_comment(raw).rstrip()
        if content.strip() in ("", "---"):
            continue
        lines.append((number, len(content) - len(content.lstrip(" ")), content.strip()))
    if not lines:
        raise LynxConfigError(f"{where}: the file is empty; a hardware file is a mapping of fields")
    data, end = _block(lines, 0, lines[0][1], where)
    if end != len(lines):
        raise _error(where, lines[end][0], "unexpected indentation")
    return data


def dumps(data: dict[str, Any], indent: int = 0) -> str:
    """Write nested dicts of scalars as block YAML that :func:`loads` reads back exactly."""
    out = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.append(f"{' ' * indent}{key}:")
            out.append(dumps(value, indent + 2).rstrip("\n"))
        else:
            out.append(f"{' ' * indent}{key}: {_scalar_text(value)}")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------- reading
def _block(lines: list[tuple[int, int, str]], i: int, indent: int, where: str) -> tuple[dict[str, Any], int]:
    mapping: dict[str, Any] = {}
    while i < len(lines):
        number, col, content = lines[i]
        if col < indent:
            break
        if col > indent:
            raise _error(where, number, "unexpected indentation")
        if content.startswith("- ") or content == "-":
            raise _error(where, number, "block lists are not supported in hardware files; use a mapping or [a, b]")
        key, sep, rest = content.partition(":")
        key = key.strip()
        if not sep or not key or (rest and not rest.startswith(" ")):
            raise _error(where, number, f"expected 'key: value', got {content!r}")
        if key in mapping:
            raise _error(where, number, f"{key!r} is given twice")
        rest = rest.strip()
        i += 1
        if rest:
            mapping[key] = _value(rest, where, number)
        elif i < len(lines) and lines[i][1] > indent:
            mapping[key], i = _block(lines, i, lines[i][1], where)
        else:
            mapping[key] = None
    return mapping, i


def _value(text: str, where: str, number: int) -> Any:
    if text[0] in "{[":
        value, end = _flow(text, 0, where, number)
        if text[end:].strip():
            raise _error(where, number, f"unexpected text after the closing bracket: {text[end:].strip()!r}")
        return value
    if text[0] in "|>&*!":
        raise _error(where, number, f"{text[0]!r} (multi-line strings, anchors, tags) is not supported here")
    return _scalar(text, where, number)


def _flow(text: str, i: int, where: str, number: int) -> tuple[Any, int]:
    """A ``{...}`` or ``[...]`` starting at ``text[i]``: (value, index after it)."""
    closing = "}" if text[i] == "{" else "]"
    items: Any = {} if closing == "}" else []
    i += 1
    while True:
        i = _skip_spaces(text, i)
        if i >= len(text):
            raise _error(where, number, f"missing {closing!r}")
        if text[i] == closing:
            return items, i + 1
        if closing == "}":
            colon = text.find(":", i)
            if colon < 0:
                raise _error(where, number, "expected 'key: value' inside { }")
            key = text[i:colon].strip()
            if not key or key in items:
                raise _error(where, number, f"bad or repeated key {key!r} inside {{ }}")
            i = _skip_spaces(text, colon + 1)
        if i < len(text) and text[i] in "{[":
            value, i = _flow(text, i, where, number)
        elif i < len(text) and text[i] in "'\"":
            end = _string_end(text, i, where, number)
            value, i = _scalar(text[i:end], where, number), end
        else:
            end = i
            while end < len(text) and text[end] not in ",}]":
                end += 1
            value, i = _scalar(text[i:end].strip(), where, number), end
        if closing == "}":
            items[key] = value
        else:
            items.append(value)
        i = _skip_spaces(text, i)
        if i < len(text) and text[i] == ",":
            i += 1


def _scalar(text: str, where: str, number: int) -> Any:
    if not text:
        raise _error(where, number, "a value is missing")
    if text[0] in "'\"":
        if len(text) < 2 or text[-1] != text[0]:
            raise _error(where, number, f"unterminated string {text!r}")
        return json.loads(text) if text[0] == '"' else text[1:-1].replace("''", "'")
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "~"):
        return None
    if lowered in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[lowered]
    if _INT.fullmatch(text):
        return int(text.replace("_", ""))
    if _FLOAT.fullmatch(text):
        return float(text.replace("_", ""))
    return text


def _string_end(text: str, i: int, where: str, number: int) -> int:
    """Index just past the quoted string starting at ``text[i]``."""
    quote, j = text[i], i + 1
    while j < len(text):
        if quote == '"' and text[j] == "\\":
            j += 2
            continue
        if text[j] == quote:
            if quote == "'" and text[j + 1 : j + 2] == "'":  # '' is a quote inside '...'
                j += 2
                continue
            return j + 1
        j += 1
    raise _error(where, number, f"unterminated string {text[i:]!r}")


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def _skip_spaces(text: str, i: int) -> int:
    while i < len(text) and text[i] == " ":
        i += 1
    return i


def _error(where: str, number: int, message: str) -> LynxConfigError:
    return LynxConfigError(f"{where}, line {number}: {message}")


# ------------------------------------------------------------------------------- writing
def _scalar_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(json.dumps(v, ensure_ascii=False) if isinstance(v, str) else _scalar_text(v)
                               for v in value) + "]"
    text = str(value)
    plain = _scalar(text, "", 0) == text if text and text[0] not in "{[|>&*!'\"" else False
    return text if plain and ": " not in text and " #" not in text else json.dumps(text, ensure_ascii=False)
