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


def serve(source: str, chan_in, chan_out) -> None:
    """Load ``source`` as module ``solution``, send ``{"ready": globals}`` (or ``{"load_error": ...}``), then
    answer one JSON line per request line on ``chan_in`` until it closes. Never returns."""
    handles, iterators = [], {}

    def send(msg):
        chan_out.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        chan_out.flush()

    def keep(v):
        handles.append(v)
        return {"$h": len(handles) - 1, "type": type(v).__name__[:80], "callable": callable(v)}

    def enc(v, depth=0):
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
            return [enc(x, d) for x in v]
        if isinstance(v, tuple):
            return {"$t": [enc(x, d) for x in v]}
        if isinstance(v, dict):
            return {"$d": [[enc(k, d), enc(x, d)] for k, x in v.items()]}
        if isinstance(v, (set, frozenset)):
            return {"$fs" if isinstance(v, frozenset) else "$s": [enc(x, d) for x in v]}
        if isinstance(v, (bytes, bytearray)):
            return {"$b": bytes(v).decode("latin-1")}
        if isinstance(v, complex):
            return {"$c": [v.real, v.imag]}
        return keep(v)

    def dec(x):
        if isinstance(x, list):
            return [dec(e) for e in x]
        if not isinstance(x, dict):
            return x
        (tag, val), = x.items()
        if tag == "$h":
            return handles[val]
        if tag == "$t":
            return tuple(dec(e) for e in val)
        if tag == "$d":
            return {dec(k): dec(e) for k, e in val}
        if tag in ("$s", "$fs"):
            return (frozenset if tag == "$fs" else set)(dec(e) for e in val)
        if tag == "$b":
            return val.encode("latin-1")
        if tag == "$c":
            return complex(*val)
        raise ValueError(f"unknown tag {tag!r}")

    def describe(e):
        try:
            msg = str(e)[:300]
        except BaseException:  # noqa: BLE001 - a solution's exception whose __str__ raises
            msg = ""
        return {"exc": type(e).__name__[:80], "msg": msg}

    def answer(req):
        op, obj = req["op"], handles[req["h"]]
        if op == "call":
            args = [dec(a) for a in req["args"]]
            kwargs = {k: dec(v) for k, v in req["kwargs"].items()}
            try:
                res = obj(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - the judge re-raises it in the test
                return describe(e)
            post = []  # arguments the call changed in place, for the judge to copy back
            for a, raw in zip(args, req["args"]):
                after = enc(a) if type(a) in (list, dict, set) else None
                post.append(after if after is not None and after != raw else None)
            return {"ok": enc(res), "post": post}
        if op == "getattr":
            try:
                return {"ok": enc(getattr(obj, req["name"]))}
            except BaseException as e:  # noqa: BLE001
                return describe(e)
        if op == "next":
            try:
                it = iterators.get(req["h"])
                if it is None:
                    it = iterators[req["h"]] = iter(obj)
                return {"ok": enc(next(it))}
            except StopIteration:
                return {"stop": True}
            except BaseException as e:  # noqa: BLE001
                return describe(e)
        return {"exc": "ValueError", "msg": f"unknown op {op!r}"}

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
            e = enc(v)
            if len(json.dumps(e)) > MAX_GLOBAL_BYTES:
                e = keep(v)
        except BaseException:  # noqa: BLE001
            e = keep(v)
        exports[k] = e
    send({"ready": exports})
    for line in chan_in:
        try:
            send(answer(json.loads(line)))
        except BaseException as e:  # noqa: BLE001 - unencodable result, bad request: reported, keep serving
            send(describe(e))
    os._exit(0)
