"""The judge's plain-data codec (``reward.channel``): what the solution sends becomes genuine built-in
objects or a ``ProtocolError``, never an object of the solution's making; ``RemoteObject`` never lets the
solution decide a comparison or a truth value."""

from __future__ import annotations

import json
import math

import pytest

from reward.channel import (
    MAX_DEPTH,
    ProtocolError,
    RemoteError,
    RemoteObject,
    decode_plain,
    encode_plain,
    remote_exception,
)


class FakeSession:
    """Records requests and answers them from a script (what ``SolutionSession.request_value`` would)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.sent = []

    def request_value(self, msg, args=()):
        self.sent.append(msg)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


VALUES = [None, True, False, 0, -7, 2**80, 1.5, -0.0, math.inf, "text", "", [1, [2, []]], (1, "a", (None,)),
          {"k": [1, 2], 3: (4,), (5, 6): None}, {1, 2, (3, 4)}, frozenset({1, frozenset({2})}), b"\x00\xffab",
          complex(1.5, -2)]


@pytest.mark.parametrize("value", VALUES, ids=[repr(v)[:30] for v in VALUES])
def test_round_trip_through_json_gives_equal_builtins(value):
    wire = json.loads(json.dumps(encode_plain(value)))
    back = decode_plain(wire)
    assert back == value and type(back) is type(value)


def test_nan_crosses_as_nan():
    assert math.isnan(decode_plain(json.loads(json.dumps(encode_plain(math.nan)))))


@pytest.mark.parametrize("wire", [
    {"$t": [1], "$s": [2]},                      # two tags
    {"x": 1},                                    # no tag
    {"$t": 5},                                   # tag with a non-list
    {"$d": [[1]]},                               # dict item that is not a pair
    {"$d": [[[1], 2]]},                          # unhashable key
    {"$s": [[1, 2]]},                            # unhashable member
    {"$b": 5},                                   # bytes that are not a string
    {"$b": "\u20ac"},                            # not latin-1
    {"$c": ["1", 2]},                            # complex with a string part
    {"$h": 1},                                   # handle without a session
    {"$h": True, "type": "x"},                   # handle id that is not an int
    {"$m": "os"},                                # a module is not a value
    {"$t": [1], "extra": 2},                     # stray field
])
def test_malformed_values_are_protocol_errors(wire):
    with pytest.raises(ProtocolError):
        decode_plain(wire, None)


def test_nesting_is_bounded():
    deep: object = 1
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(ProtocolError, match="nested too deeply"):
        decode_plain(deep)
    with pytest.raises(TypeError, match="nested too deeply"):
        encode_plain(deep)


def test_only_plain_data_is_sent():
    session = FakeSession([])
    with pytest.raises(TypeError, match="cannot pass a function"):
        encode_plain(lambda x: x, session)
    other = RemoteObject(FakeSession([]), 0, "function", True)
    with pytest.raises(TypeError, match="earlier run of the solution"):
        encode_plain(other, session)
    assert encode_plain(RemoteObject(session, 3, "A", False), session) == {"$h": 3}


def test_remote_object_decides_nothing_itself():
    session = FakeSession([7, "x", 3, StopIteration(), 4])
    handle = decode_plain({"$h": 4, "type": "A", "callable": True}, session)
    assert isinstance(handle, RemoteObject)
    assert (handle == 4) is False and (handle != 4) is True and handle == handle
    with pytest.raises(TypeError, match="truth value"):
        bool(handle)
    with pytest.raises(TypeError):
        len(handle)
    with pytest.raises(AttributeError):
        handle.__contains__  # noqa: B018 - dunders are not forwarded to the solution
    with pytest.raises(AttributeError):
        handle.attr = 1
    assert handle(2, k=[1]) == 7 and handle.name == "x"
    # ``in`` has no __contains__ of the solution's to call: it iterates, and the judge compares plain items
    assert (4 in handle) is False and (4 in handle) is True
    assert session.sent[:2] == [{"op": "call", "h": 4, "args": [2], "kwargs": {"k": [1]}},
                                {"op": "getattr", "h": 4, "name": "name"}]
    assert session.sent[2:] == [{"op": "next", "h": 4}] * 3  # the second stops at the match


def test_remote_exceptions_map_to_builtins_only():
    assert type(remote_exception({"exc": "ValueError", "msg": "bad"})) is ValueError
    assert type(remote_exception({"exc": "KeyError", "msg": "'k'"})) is KeyError
    for name in ("MyError", "SystemExit", "KeyboardInterrupt", "StopIteration", "SessionLost", "object"):
        assert type(remote_exception({"exc": name, "msg": ""})) is RemoteError, name
    assert type(remote_exception({"exc": "UnicodeDecodeError", "msg": "x"})) is RemoteError  # needs 5 args
    assert type(remote_exception("junk")) is ProtocolError
