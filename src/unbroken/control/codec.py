"""Messages to and from JSON: dataclasses of plain values, enums, lists, dicts and Optionals.

Decoding builds only the declared dataclass from plain JSON values: nothing in the store is
ever executed or unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from enum import Enum
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")


def to_plain(value: Any) -> Any:
    """A message (or any value inside one) as plain JSON-able values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_plain(v) for v in value]
    return value


def encode(message: Any) -> str:
    return json.dumps(to_plain(message), separators=(",", ":"))


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_plain(tp: Any, value: Any) -> Any:
    """Build a value of type `tp` from plain JSON values (unknown fields are ignored)."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return from_plain(args[0], value) if len(args) == 1 else value
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        names = {f.name for f in dataclasses.fields(tp) if f.init}
        return tp(**{k: from_plain(hints[k], v) for k, v in value.items() if k in names})
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tp(value)
    if origin in (list, tuple):
        (arg, *_) = typing.get_args(tp) or (Any,)
        return [from_plain(arg, v) for v in value]
    if origin is dict:
        kt, vt = typing.get_args(tp) or (Any, Any)
        return {from_plain(kt, k): from_plain(vt, v) for k, v in value.items()}
    if tp is int and isinstance(value, str):
        return int(value)  # a dict key written as JSON
    return value


def decode(tp: type[T], text: str | bytes) -> T:
    return from_plain(tp, json.loads(text))
