"""YAML for hardware files: PyYAML, reading numbers as YAML 1.2 does and refusing repeated keys.

PyYAML implements YAML 1.1, where ``1e12`` and ``5e-6`` (no dot, or no exponent sign) are
strings; hardware files write bandwidths and latencies exactly so, so :func:`loads` adds YAML
1.2's float rule. A key given twice is an error naming its line (PyYAML keeps the last one
silently), and a syntax error names the file and the line.

Example::

    >>> from lynx.planner.yaml_files import dumps, loads
    >>> data = loads("pp: {alpha_s: 30e-6, beta_bytes_per_s: 2.9e9}\\nname: my-cluster\\n", "c.yaml")
    >>> data["pp"]["alpha_s"], data["pp"]["beta_bytes_per_s"], data["name"]
    (3e-05, 2900000000.0, 'my-cluster')
    >>> loads(dumps(data), "again.yaml") == data
    True
    >>> loads("a: 1\\na: 2\\n", "c.yaml")
    Traceback (most recent call last):
    ...
    lynx.errors.LynxConfigError: c.yaml, line 2: 'a' is given twice
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from lynx.errors import LynxConfigError

__all__ = ["loads", "dumps"]

# YAML 1.2 core schema floats: 1e12, 5e-6, .5, 2.5E+3, inf, nan (YAML 1.1 wants a dot and a sign)
_FLOAT_12 = re.compile(r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
                          |[-+]?\.(?:inf|Inf|INF)
                          |\.(?:nan|NaN|NAN))$""", re.X)


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise LynxConfigError(f"{self.name}, line {key_node.start_mark.line + 1}: {key!r} is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """Quotes a string that the loader would read as a number (``"1e3"``)."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789.in"))


def loads(text: str, where: str) -> Any:
    """Parse ``text``; ``where`` names it in errors (a file path)."""
    loader = _Loader(text)
    loader.name = where
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = f", line {mark.line + 1}" if mark is not None else ""
        raise LynxConfigError(f"{where}{line}: not valid YAML: {err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise LynxConfigError(f"{where}: not valid YAML: {err}") from None
    finally:
        loader.dispose()


def dumps(data: Any) -> str:
    """YAML text in the order given (what :func:`loads` reads back equal)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)
