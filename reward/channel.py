"""The judge's side of the channel to a sandboxed solution: the wire codec and the proxies.

Only plain data crosses (the wire format is described in ``reward/_harness.py``). ``decode_plain`` turns an
answer of the solution into genuine built-in objects (strict: anything malformed is a ``ProtocolError``), so
whatever the tests do with it (``==``, ``abs``, ``isinstance``) runs the judge's code, never the solution's.
A value that is not plain data stays in the sandbox and is seen here as a ``RemoteObject``.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Any, Protocol

MAX_DEPTH = 100  # nesting of one value, both ways


class Requester(Protocol):
    """What a ``RemoteObject`` needs from its session (``reward.judge.SolutionSession``)."""

    def request_value(self, msg: dict, args: tuple = ()) -> Any: ...


@dataclass(frozen=True)
class ModuleRef:
    """A global of the solution that is a module: only its name crosses (see ``reward.judge.SAFE_MODULES``)."""

    name: str


class ProtocolError(Exception):
    """The solution's harness answered something that is not a well-formed message of plain data."""


class SessionLost(BaseException):
    """The solution's process died, ran out of time, flooded its output or broke the protocol. A
    ``BaseException``, so that a test's ``except Exception`` does not take it for an expected error (a test
    during which the session was lost fails whatever the test does with it)."""


class RemoteError(Exception):
    """An exception raised by the solution whose type is not a built-in exception (message: its name)."""


class RemoteObject:
    """A value of the solution that is not plain data (a function, a class, an instance, a generator).

    Usable only through what cannot decide a verdict by itself: calling it, reading a public attribute and
    iterating over it (each one a request to the solution, answered with plain data or another remote object).
    It compares by identity, has no truth value and never runs the solution's ``__eq__``/``__bool__``/
    ``__contains__``/``__len__``: a solution whose answers are not plain data can only fail a comparison.
    """

    __slots__ = ("_session", "_id", "_type", "_callable")

    def __init__(self, session: "Requester", ident: int, type_name: str, is_callable: bool):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_id", ident)
        object.__setattr__(self, "_type", type_name)
        object.__setattr__(self, "_callable", is_callable)

    def __call__(self, *args, **kwargs):
        session = self._session
        msg = {"op": "call", "h": self._id, "args": [encode_plain(a, session) for a in args],
               "kwargs": {str(k): encode_plain(v, session) for k, v in kwargs.items()}}
        return session.request_value(msg, args)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in RemoteObject.__slots__:
            raise AttributeError(name)
        return self._session.request_value({"op": "getattr", "h": self._id, "name": name})

    def __setattr__(self, name, value):
        raise AttributeError("attributes of the solution's objects cannot be set from the tests")

    def __iter__(self):
        return _RemoteIterator(self)

    def __bool__(self):
        raise TypeError(f"the truth value of the solution's {self._type} object is not trusted")

    def __repr__(self) -> str:
        return f"<solution {self._type} #{self._id}>"


class _RemoteIterator:
    __slots__ = ("_obj",)

    def __init__(self, obj: RemoteObject):
        self._obj = obj

    def __iter__(self):
        return self

    def __next__(self):
        session = self._obj._session
        return session.request_value({"op": "next", "h": self._obj._id})


def encode_plain(value: Any, session: "Requester | None" = None, depth: int = 0) -> Any:
    """``value`` (plain data from a test: None, bool, int, float, str, bytes, complex, and lists, tuples,
    dicts, sets of these) in the channel's JSON form; a ``RemoteObject`` of ``session`` as its handle.

    Raises:
        TypeError: anything else (a lambda, a local class instance...): only plain data crosses the sandbox.
    """
    if depth > MAX_DEPTH:
        raise TypeError("value nested too deeply to send to the solution")
    d = depth + 1
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, list):
        return [encode_plain(x, session, d) for x in value]
    if isinstance(value, tuple):
        return {"$t": [encode_plain(x, session, d) for x in value]}
    if isinstance(value, dict):
        return {"$d": [[encode_plain(k, session, d), encode_plain(x, session, d)] for k, x in value.items()]}
    if isinstance(value, (set, frozenset)):
        return {"$fs" if isinstance(value, frozenset) else "$s": [encode_plain(x, session, d) for x in value]}
    if isinstance(value, (bytes, bytearray)):
        return {"$b": bytes(value).decode("latin-1")}
    if isinstance(value, complex):
        return {"$c": [value.real, value.imag]}
    if isinstance(value, RemoteObject):
        if value._session is not session:
            raise TypeError(f"{value!r} belongs to an earlier run of the solution")
        return {"$h": value._id}
    raise TypeError(f"cannot pass a {type(value).__name__} to the solution: only plain data crosses the sandbox")


_TAGS = {"$t", "$d", "$s", "$fs", "$b", "$c", "$h", "$m"}


def decode_plain(x: Any, session: "Requester | None" = None, depth: int = 0) -> Any:
    """A channel JSON value (as ``json.loads`` returns it) as genuine built-in objects: the inverse of
    ``encode_plain``; a handle becomes a ``RemoteObject`` of ``session``.

    Raises:
        ProtocolError: anything that is not a well-formed value (unknown tag, wrong field types, unhashable
            set members or dict keys, nesting deeper than ``MAX_DEPTH``, or a handle without a session).
    """
    if depth > MAX_DEPTH:
        raise ProtocolError("value nested too deeply")
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    d = depth + 1
    if t is list:
        return [decode_plain(e, session, d) for e in x]
    if t is not dict:
        raise ProtocolError(f"unexpected JSON type {t.__name__}")
    keys = set(x)
    tags = keys & _TAGS
    if len(tags) != 1:
        raise ProtocolError("a JSON object must carry exactly one type tag")
    tag = tags.pop()
    val = x[tag]
    try:
        if tag == "$h":
            if session is None or type(val) is not int or not keys <= {"$h", "type", "callable"}:
                raise ProtocolError("malformed handle")
            return RemoteObject(session, val, str(x.get("type", "object"))[:80], bool(x.get("callable")))
        if len(keys) != 1:
            raise ProtocolError(f"unexpected fields next to {tag}")
        if tag == "$m":
            raise ProtocolError("a module is not a value")
        if tag == "$b":
            if type(val) is not str:
                raise ProtocolError("bytes must be a latin-1 string")
            return val.encode("latin-1")
        if type(val) is not list:
            raise ProtocolError(f"{tag} needs a list")
        if tag == "$c":
            if len(val) != 2 or not all(type(v) in (int, float) for v in val):
                raise ProtocolError("complex needs two numbers")
            return complex(float(val[0]), float(val[1]))
        items = [decode_plain(e, session, d) for e in val]
        if tag == "$t":
            return tuple(items)
        if tag == "$s":
            return set(items)
        if tag == "$fs":
            return frozenset(items)
        pairs = []
        for pair in items:
            if type(pair) is not list or len(pair) != 2:
                raise ProtocolError("dict items must be [key, value] pairs")
            pairs.append(pair)
        return dict(pairs)
    except (TypeError, UnicodeEncodeError, OverflowError) as err:  # unhashable key/member, non-latin-1 bytes
        raise ProtocolError(f"malformed {tag}: {type(err).__name__}") from None


def remote_exception(detail: Any) -> BaseException:
    """The exception to raise in the tests for one the solution raised (``{"exc": name, "msg": text}``): the
    built-in exception of that name (``ValueError``, ``KeyError``...), else ``RemoteError``; a
    ``ProtocolError`` when ``detail`` is malformed. ``StopIteration`` and non-``Exception`` types (``SystemExit``)
    become ``RemoteError``."""
    if type(detail) is not dict:
        return ProtocolError("malformed exception report")
    name, msg = str(detail.get("exc", ""))[:80], str(detail.get("msg", ""))[:300]
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, StopIteration):
        try:
            return cls(msg)
        except Exception:  # noqa: BLE001 - exceptions with required arguments (UnicodeDecodeError...)
            pass
    return RemoteError(f"{name}: {msg}" if msg else name)
