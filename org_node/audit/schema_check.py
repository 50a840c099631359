"""The subset of JSON Schema the audit report's schema uses, checked without a library.

The keywords: ``type``, ``const``, ``enum``, ``minimum``, ``pattern``, ``required``, ``properties``,
``additionalProperties``, ``items`` and local ``$ref``; the first violation is raised as
``error(path, message)``."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["check_against_schema"]


def check_against_schema(
    value: Any,
    schema: Mapping[str, Any],
    path: str,
    error: Callable[[str, str], Exception],
) -> None:
    """Check ``value`` against ``schema`` (its own root for ``$ref``); raise
    ``error(path, message)`` at the first field that does not match."""
    _check(value, schema, path, schema, error)


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _check(
    value: Any,
    schema: Mapping[str, Any],
    path: str,
    root: Mapping[str, Any],
    error: Callable[[str, str], Exception],
) -> None:
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        _check(value, root["$defs"][name], path, root, error)
        return
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any(
            isinstance(value, _TYPES[t])
            and not (t in ("integer", "number") and isinstance(value, bool))
            for t in types
        )
        if not ok:
            raise error(path, f"expected {' or '.join(types)}")
    if "const" in schema and value != schema["const"]:
        raise error(path, f"must be {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise error(path, f"must be one of {', '.join(map(str, schema['enum']))}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            raise error(path, f"must be >= {schema['minimum']}")
        if isinstance(value, float) and not math.isfinite(value):
            raise error(path, "must be finite")
    if (
        isinstance(value, str)
        and "pattern" in schema
        and not re.fullmatch(schema["pattern"], value)
    ):
        raise error(path, f"does not match {schema['pattern']}")
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                raise error(path, f"missing {key!r}")
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            extra = sorted(set(value) - set(props))
            if extra:
                raise error(path, f"unexpected {', '.join(extra)}")
        extra_schema = schema.get("additionalProperties")
        for key, sub in value.items():
            if key in props:
                _check(sub, props[key], f"{path}.{key}", root, error)
            elif isinstance(extra_schema, dict):
                _check(sub, extra_schema, f"{path}.{key}", root, error)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]", root, error)
