"""The wire's fast paths: a record's checks and its encoding compiled to Python, once.

Why this exists: a no-op task's round trip decodes four records on its path (the submit in
the broker, the task in each rank, each rank's report, the verdict in the client), and the
generic checkers of :mod:`cpq.wirecheck` spend a call, a dict lookup and an ``isinstance``
per field: ~12 us for a submit, a tenth of the broker's own time per task (docs/design.md
"Dispatch"). Like :mod:`dataclasses` writing ``__init__``, this writes one function per
record type that tests each field's exact type inline.

It only ever *accepts*: data it is not sure of (a wrong or unusual type, an unknown or
missing field, a value the record refuses) makes it hand the whole map to the exact
checker, which decides and words the error. So what decodes, and every
:class:`~cpq.wirecheck.ProtocolError` and its text, are the exact checker's, by
construction; the fast path can only be slower than it might, never more lenient.

Encoding (:func:`encoder`) leaves out every field that holds its default, of exactly the
default's type: the receiver's checker fills them in again, as it always has for a field a
peer did not send. A no-op's verdict for two ranks is then a fifth of its full size, which
is what msgpack packs and unpacks and the checker walks on each of the path's four hops.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin

from cpq.wirecheck import Check, ProtocolError, checker, hints


class _Unsure(Exception):
    """The fast path is not sure of the data: the exact checker decides."""


_MISSING = object()
_FAST: dict[type, Callable[[Any], Any]] = {}


def record_checker(cls: type, exact: Check) -> Check:
    """``exact``'s checker for record type ``cls``, with the compiled fast path in front."""
    fast = _compiled(cls)

    def check(data: Any, where: str) -> Any:
        try:
            return fast(data)
        except (_Unsure, ProtocolError):
            return exact(data, where)

    return check


def _compiled(cls: type) -> Callable[[Any], Any]:
    found = _FAST.get(cls)
    if found is None:
        found = _FAST[cls] = _compile(cls)
    return found


def _compile(cls: type) -> Callable[[Any], Any]:
    fields = hints(cls)
    required = frozenset(
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    scope: dict[str, Any] = {
        "cls": cls,
        "Unsure": _Unsure,
        "MISSING": _MISSING,
        "KNOWN": frozenset(fields),
        "REQUIRED": required,
    }
    lines = [
        "def fast(d):",
        "    if type(d) is not dict or not KNOWN.issuperset(d):",
        "        raise Unsure",
    ]
    if required:
        lines += ["    if not REQUIRED.issubset(d):", "        raise Unsure"]
    lines.append("    kw = d.copy()")
    for number, (name, hint) in enumerate(fields.items()):
        body = _field_lines(hint, f"kw[{name!r}]", f"f{number}", scope)
        if body:
            lines.append(f"    v = d.get({name!r}, MISSING)")
            lines.append("    if v is not MISSING:")
            lines += [f"        {line}" for line in body]
    lines += [
        "    try:",
        "        return cls(**kw)",
        "    except ValueError:",  # the record refused its values: the exact path words it
        "        raise Unsure from None",
    ]
    exec("\n".join(lines), scope)
    fast: Callable[[Any], Any] = scope["fast"]
    return fast


def _field_lines(hint: Any, slot: str, name: str, scope: dict[str, Any]) -> list[str]:
    """Statements that accept ``v`` as ``hint`` (converting it into ``slot`` where the
    record holds another type than msgpack gives) or raise ``Unsure``; [] for ``Any``."""
    if hint is Any:
        return []
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1 and len(args) == 2:  # X | None
            inner = _field_lines(options[0], slot, name, scope)
            return ["if v is not None:", *(f"    {line}" for line in inner)] if inner else []
    elif hint in (str, int, bool, bytes):  # exact: msgpack gives no subclasses (nor bool for int)
        scope[name] = hint
        return [f"if type(v) is not {name}:", "    raise Unsure"]
    elif hint is float:
        return [
            "if type(v) is not float:",
            "    if type(v) is not int:",
            "        raise Unsure",
            f"    {slot} = float(v)",
        ]
    elif origin is Literal and all(type(a) is str for a in args):
        scope[name] = frozenset(args)
        return [f"if type(v) is not str or v not in {name}:", "    raise Unsure"]
    elif origin is dict and args[0] is str and args[1] in (Any, str):
        lines = ["if type(v) is not dict:", "    raise Unsure"]
        if args[1] is str:
            lines += ["for i in v.values():", "    if type(i) is not str:", "        raise Unsure"]
        return lines
    elif origin is list:
        item = args[0]
        lines = ["if type(v) is not list:", "    raise Unsure"]
        if item is Any:
            return lines
        if item in (str, bytes) or (get_origin(item) is dict and get_args(item) == (str, Any)):
            scope[name] = dict if get_origin(item) is dict else item
            return [*lines, "for i in v:", f"    if type(i) is not {name}:", "        raise Unsure"]
        if get_origin(item) is list and get_args(item)[0] is str:  # a spec's [name, value]s
            return [
                *lines,
                "for i in v:",
                "    if type(i) is not list:",
                "        raise Unsure",
                "    for j in i:",
                "        if type(j) is not str:",
                "            raise Unsure",
            ]
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            scope[name] = _compiled(item)
            return [*lines, f"{slot} = [{name}(i) for i in v]"]
    elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
        scope[name] = _compiled(hint)
        return [f"{slot} = {name}(v)"]
    scope[name] = checker(hint)  # anything else: the exact checker (its error: Unsure too)
    return [f"{slot} = {name}(v, '')"]


_ENCODE: dict[type, Callable[[Any], dict[str, Any]]] = {}


def encoder(cls: type) -> Callable[[Any], dict[str, Any]]:
    """A function from a record of type ``cls`` to its wire map, defaults left out."""
    found = _ENCODE.get(cls)
    if found is None:
        found = _ENCODE[cls] = _compile_encoder(cls)
    return found


def _compile_encoder(cls: type) -> Callable[[Any], dict[str, Any]]:
    scope: dict[str, Any] = {}
    lines = ["def encode(o):", "    out = {}"]
    for number, field in enumerate(dataclasses.fields(cls)):
        name, value = field.name, f"o.{field.name}"
        converted = _wire_value(hints(cls)[name], "v", f"e{number}", scope)
        if field.default is not dataclasses.MISSING:
            scope[f"d{number}"], scope[f"t{number}"] = field.default, type(field.default)
            lines += [
                f"    v = {value}",
                f"    if type(v) is not t{number} or v != d{number}:",
                f"        out[{name!r}] = {converted}",
            ]
        elif field.default_factory is not dataclasses.MISSING:
            made = field.default_factory()
            scope[f"d{number}"], scope[f"t{number}"] = made, type(made)
            lines += [
                f"    v = {value}",
                f"    if type(v) is not t{number} or v != d{number}:",  # [] and {} stay home
                f"        out[{name!r}] = {converted}",
            ]
        else:
            lines += [f"    v = {value}", f"    out[{name!r}] = {converted}"]
    lines.append("    return out")
    exec("\n".join(lines), scope)
    encode: Callable[[Any], dict[str, Any]] = scope["encode"]
    return encode


def _wire_value(hint: Any, var: str, name: str, scope: dict[str, Any]) -> str:
    """The expression that turns ``var``, a value of ``hint``, into plain msgpack data."""
    origin, args = get_origin(hint), get_args(hint)
    options = [a for a in args if a is not type(None)] if origin in (Union, types.UnionType) else []
    if len(options) == 1 and _is_record(options[0]):
        scope[name] = encoder(options[0])
        return f"(None if {var} is None else {name}({var}))"
    if _is_record(hint):
        scope[name] = encoder(hint)
        return f"{name}({var})"
    if origin is list and _is_record(args[0]):
        scope[name] = encoder(args[0])
        return f"[{name}(i) for i in {var}]"
    if any(_is_record(a) for a in args):  # a union of records: by the value's own type
        scope[name] = _any_record
        return f"{name}({var})"
    return var  # user data (``Any``) and plain values go to msgpack as they are


def _any_record(value: Any) -> Any:
    return encoder(type(value))(value) if _is_record(type(value)) else value


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)
