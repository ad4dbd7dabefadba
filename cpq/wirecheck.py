"""The validating decoder behind :func:`cpq.protocol.decode`: type hints become checkers.

Kept apart from :mod:`cpq.protocol` (which lists the messages) because it is the one
generic piece of it: given a record type, build once a converter that checks plain
msgpack data against the type's hints (wrong types, unknown or missing fields) and builds
the record, raising :class:`ProtocolError` on anything off. Decoding is on the hot path of
every task (broker and ranks), so hints are interpreted once per type and cached.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """A record type's field hints, resolved once."""
    found = _HINTS.get(cls)
    if found is None:
        found = {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}
        _HINTS[cls] = found
    return found


Check = Callable[[Any, str], Any]
_CHECKS: dict[Any, Check] = {}


def checker(hint: Any) -> Check:
    """A validating converter for ``hint``, built once per type and cached.

    Decoding is on the hot path of every task (broker and ranks), so the type hints are
    interpreted once here rather than on every message.
    """
    check = _CHECKS.get(hint)
    if check is None:
        check = _CHECKS[hint] = _buildchecker(hint)
    return check


def _buildchecker(hint: Any) -> Check:
    if hint is Any:
        return lambda value, where: value
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        optional = type(None) in get_args(hint)
        options = [checker(o) for o in get_args(hint) if o is not type(None)]

        def check_union(value: Any, where: str) -> Any:
            if value is None and optional:
                return None
            error: ProtocolError | None = None
            for option in options:
                try:
                    return option(value, where)
                except ProtocolError as exc:
                    error = exc
            raise error or ProtocolError(f"{where}: unexpected {type(value).__name__}")

        return check_union
    if origin is list:
        item = checker(get_args(hint)[0])
        plain = get_args(hint)[0] is Any
        strings = get_args(hint)[0] is str

        def check_list(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
            if plain or (strings and all(type(v) is str for v in value)):
                return value  # the common case, without a call per item
            return [item(v, where) for v in value]

        return check_list
    if origin is dict:
        item = checker(get_args(hint)[1])
        plain = get_args(hint)[1] is Any
        strings = get_args(hint)[1] is str

        def check_map(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
            if plain or (strings and all(type(v) is str for v in value.values())):
                return value  # an environment: dozens of strings, one pass
            return {k: item(v, where) for k, v in value.items()}

        return check_map
    if origin is Literal:
        allowed = frozenset(get_args(hint))

        def check_literal(value: Any, where: str) -> Any:
            # a value the receiver does not know is malformed (fail closed), never a default
            if isinstance(value, str) and value in allowed:
                return value
            raise ProtocolError(f"{where}: {value!r} is not one of {sorted(allowed)}")

        return check_literal
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _record_checker(hint)
    if hint is float:

        def check_float(value: Any, where: str) -> Any:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            raise ProtocolError(f"{where}: expected float, got {type(value).__name__}")

        return check_float
    exact = hint

    def check_scalar(value: Any, where: str) -> Any:
        if isinstance(value, exact) and not (exact is int and isinstance(value, bool)):
            return value
        raise ProtocolError(f"{where}: expected {exact.__name__}, got {type(value).__name__}")

    return check_scalar


def _record_checker(cls: type) -> Check:
    fields = {name: checker(hint) for name, hint in hints(cls).items()}
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }

    paths: dict[str, dict[str, str]] = {}  # where -> field -> "where.field", built once

    def check_record(data: Any, where: str) -> Any:
        if not isinstance(data, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(data).__name__}")
        named = paths.get(where)
        if named is None:
            named = paths[where] = {name: f"{where}.{name}" for name in fields}
        values = {}
        for name, value in data.items():
            check = fields.get(name)
            if check is None:
                raise ProtocolError(f"{where}: unknown field {name!r}")
            values[name] = check(value, named[name])
        missing = required - values.keys()
        if missing:
            raise ProtocolError(f"{where}: missing field(s) {sorted(missing)}")
        try:
            return cls(**values)
        except ValueError as exc:  # the record refused its values (PoolSpec.__post_init__)
            raise ProtocolError(f"{where}: {exc}") from None

    return check_record
