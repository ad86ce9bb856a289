"""Strict JSON for files people edit or bring from elsewhere: hardware files, plans, checkpoints.

Python's ``json`` keeps the last of a key given twice and reads the non-JSON tokens ``NaN``
and ``Infinity``; a hand-edited hardware file or plan would then mean something else than it
says. :func:`loads` refuses both, naming the file (and, for a syntax error, the line), as
:mod:`lynx.planner.yaml_files` does for YAML. :func:`dumps` refuses to write them.

Example::

    >>> from lynx.json_files import loads
    >>> loads('{"alpha_s": 3e-5, "links": {"pp": 1}}', "c.json")
    {'alpha_s': 3e-05, 'links': {'pp': 1}}
    >>> loads('{"a": 1, "a": 2}', "c.json")
    Traceback (most recent call last):
    ...
    lynx.errors.LynxConfigError: c.json: 'a' is given twice in one object (line 1)
    >>> loads('{"a": NaN}', "c.json")
    Traceback (most recent call last):
    ...
    lynx.errors.LynxConfigError: c.json: NaN is not a JSON number (line 1); give a finite number
"""

from __future__ import annotations

import json
import re
from typing import Any

from lynx.errors import LynxConfigError

__all__ = ["loads", "dumps"]


class _Refused(Exception):
    """Carries a message out of the decoder's hooks (wrapped once with the file's name)."""


def _line(text: str, token: str) -> str:
    """The line of the first occurrence of ``token`` (what the hooks cannot see), as ``(line N)``."""
    at = text.find(token)
    return "" if at < 0 else f" (line {text.count(chr(10), 0, at) + 1})"


def loads(text: str | bytes, where: str, error: type[Exception] = LynxConfigError) -> Any:
    """Parse ``text``; ``where`` names it in errors, raised as ``error`` (a LynxError type)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise error(f"{where}: not valid JSON: not UTF-8 text ({err.reason} at byte {err.start})") from None

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                # the line of the key's second occurrence as a key (the hook sees no positions)
                found = [m.start() for m in re.finditer(re.escape(json.dumps(key)) + r"\s*:", text)]
                line = f" (line {text.count(chr(10), 0, found[1]) + 1})" if len(found) > 1 else ""
                raise _Refused(f"{key!r} is given twice in one object{line}")
            out[key] = value
        return out

    def constant(token: str) -> Any:
        raise _Refused(f"{token} is not a JSON number{_line(text, token)}; give a finite number")

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except _Refused as err:
        raise error(f"{where}: {err}") from None
    except json.JSONDecodeError as err:
        raise error(f"{where}, line {err.lineno}: not valid JSON: {err.msg}") from None
    except RecursionError:
        raise error(f"{where}: not valid JSON: nested too deeply") from None


def dumps(data: Any, indent: int | None = 1) -> str:
    """JSON text of ``data``; a NaN or infinity in it is an error (it would not be JSON)."""
    return json.dumps(data, indent=indent, allow_nan=False)
