"""The solution's side of the judge's channel. Runs inside the sandbox only: ``reward.sandbox``'s launcher
compiles this file's text (it is never imported by the judge) and calls ``serve``.

Nothing here decides a verdict, and nothing here is trusted: the solution shares this interpreter and can
replace any of it. Its only job, for an honest solution, is to load the solution, describe its globals, and
answer the judge's requests (call, read an attribute, next item) with plain data as JSON lines. The judge
(``reward.judge``) decodes every answer strictly into built-in types; see ``reward/README.md``.

Wire format of a value: JSON null/bool/int/float/str/list as themselves, and one-key objects for the rest:
``{"$t": [...]}`` tuple, ``{"$s": [...]}`` set, ``{"$fs": [...]}`` frozenset, ``{"$d": [[k, v], ...]}`` dict,
``{"$b": latin-1 str}`` bytes, ``{"$c": [re, im]}`` complex, ``{"$h": id, "type": name, "callable": bool}`` a
handle to a value that is not plain data, ``{"$m": name}`` a module (in the globals only).
"""

import json
import os
import types

MAX_DEPTH = 100
MAX_GLOBAL_BYTES = 65536  # a plain global larger than this is sent as a handle


class Handles:
    """The solution's values that are not plain data, by the number the judge knows them by."""

    def __init__(self):
        self.values = []
        self.iterators = {}

    def keep(self, v):
        self.values.append(v)
        return {"$h": len(self.values) - 1, "type": type(v).__name__[:80], "callable": callable(v)}


def enc(handles, v, depth=0):
    """``v`` in the wire format (a handle for what is not plain data)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if v is None or isinstance(v, bool):
        return None if v is None else bool(v)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, str):
        return str(v)
    if isinstance(v, list):
        return [enc(handles, x, d) for x in v]
    if isinstance(v, tuple):
        return {"$t": [enc(handles, x, d) for x in v]}
    if isinstance(v, dict):
        return {"$d": [[enc(handles, k, d), enc(handles, x, d)] for k, x in v.items()]}
    if isinstance(v, (set, frozenset)):
        return {"$fs" if isinstance(v, frozenset) else "$s": [enc(handles, x, d) for x in v]}
    if isinstance(v, (bytes, bytearray)):
        return {"$b": bytes(v).decode("latin-1")}
    if isinstance(v, complex):
        return {"$c": [v.real, v.imag]}
    return handles.keep(v)


def dec(handles, x):
    """A wire value from the judge as a Python value (a handle as the value it stands for)."""
    if isinstance(x, list):
        return [dec(handles, e) for e in x]
    if not isinstance(x, dict):
        return x
    (tag, val), = x.items()
    if tag == "$h":
        return handles.values[val]
    if tag == "$t":
        return tuple(dec(handles, e) for e in val)
    if tag == "$d":
        return {dec(handles, k): dec(handles, e) for k, e in val}
    if tag in ("$s", "$fs"):
        return (frozenset if tag == "$fs" else set)(dec(handles, e) for e in val)
    if tag == "$b":
        return val.encode("latin-1")
    if tag == "$c":
        return complex(*val)
    raise ValueError(f"unknown tag {tag!r}")


def describe(e):
    """An exception as ``{"exc": type name, "msg": text}``."""
    try:
        msg = str(e)[:300]
    except BaseException:  # noqa: BLE001 - a solution's exception whose __str__ raises
        msg = ""
    return {"exc": type(e).__name__[:80], "msg": msg}


def answer(handles, req):
    """The answer to one request: ``call`` (with ``post``: arguments changed in place), ``getattr``, ``next``."""
    op, obj = req["op"], handles.values[req["h"]]
    try:
        if op == "call":
            args = [dec(handles, a) for a in req["args"]]
            kwargs = {k: dec(handles, v) for k, v in req["kwargs"].items()}
            res = obj(*args, **kwargs)
            post = []  # arguments the call changed in place, for the judge to copy back
            for a, raw in zip(args, req["args"]):
                after = enc(handles, a) if type(a) in (list, dict, set) else None
                post.append(after if after is not None and after != raw else None)
            return {"ok": enc(handles, res), "post": post}
        if op == "getattr":
            return {"ok": enc(handles, getattr(obj, req["name"]))}
        if op == "next":
            it = handles.iterators.get(req["h"])
            if it is None:
                it = handles.iterators[req["h"]] = iter(obj)
            return {"ok": enc(handles, next(it))}
    except StopIteration:
        if op == "next":
            return {"stop": True}
        raise
    return {"exc": "ValueError", "msg": f"unknown op {op!r}"}


def serve(source: str, chan_in, chan_out) -> None:
    """Load ``source`` as module ``solution``, send ``{"ready": globals}`` (or ``{"load_error": ...}``), then
    answer one JSON line per request line on ``chan_in`` until it closes. Never returns."""
    handles = Handles()

    def send(msg):
        chan_out.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        chan_out.flush()

    g = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(source, "main.py", "exec"), g)
    except BaseException as e:  # noqa: BLE001 - SystemExit and os._exit alike: the solution did not load
        send({"load_error": describe(e)})
        os._exit(1)
    exports = {}
    for k, v in list(g.items()):
        if k.startswith("__"):
            continue
        if isinstance(v, types.ModuleType):
            exports[k] = {"$m": v.__name__}
            continue
        try:
            e = enc(handles, v)
            if len(json.dumps(e)) > MAX_GLOBAL_BYTES:
                e = handles.keep(v)
        except BaseException:  # noqa: BLE001
            e = handles.keep(v)
        exports[k] = e
    send({"ready": exports})
    for line in chan_in:
        try:
            send(answer(handles, json.loads(line)))
        except BaseException as e:  # noqa: BLE001 - the solution raised, or a bad value: reported, keep serving
            send(describe(e))
    os._exit(0)
