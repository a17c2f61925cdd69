"""The environment interface of multi-turn episodes: what a user implements, and the tools-only environment.

An episode: the model answers (an assistant turn); the rollout's tool-call parser turns the tool calls in that
text into plain dicts ``{"name": str, "arguments": dict}``; the environment answers with observation messages,
says whether the episode is done and may give a per-turn reward; when the episode ends it gives the episode's
reward. Environments run in env workers (``reward.env_worker.EnvWorker``), never in the driver; the worker
puts deadlines on every call and turns failures into episode statuses (see there).

Two ways to define one (config section ``env``, ``reward.config.EnvConfig``):

- ``env.cls: module.path:Class``: a subclass of ``Environment`` (the contract is its docstring);
- ``env.tools: [module.path:function, ...]``: tool functions only, in a ``ToolsEnvironment``, whose episode
  reward is the row's verifier (``reward.verifiers``) on the final assistant text.

Tool schemas for the chat template's ``tools=`` come from ``transformers.utils.get_json_schema`` (type hints
and a Google-style docstring with an ``Args:`` line per argument); ``tool_schema`` turns its refusal into a
``ToolSchemaError`` naming the tool.

``module:name`` strings are resolved here (``resolve_user_object``; the module is imported as a user verifier's,
``reward.verifiers.import_user_module``), on the reward side: ``cluster/runtime/user_code.py`` (which checks user
code on the driver and ships its module to the workers) is in ``cluster/``, which ``reward/`` does not import.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import math
import numbers
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from reward.infra import InfraFailure
from reward.verifiers import as_row_dict, import_user_module

if TYPE_CHECKING:
    from reward.deadline import DeadlineRunner

TOOL_MARK = "__env_tool__"  # the attribute ``@tool`` sets on a function
OBSERVATION_ERROR_CHARS = 500  # longest error text sent back to the model in one observation
_TOOL_DEADLINE = threading.local()  # .value: (runner, seconds, sandbox) while run_with_tool_deadline runs here
_TOOL_CONTEXT = threading.local()  # .value: the ToolContext of the tool call running in this thread
SANDBOX_MARK = "__env_sandbox__"  # set (True) on a tool function that runs model-written code in reward.sandbox


@dataclass(frozen=True)
class ToolContext:
    """What a tool function may know of the call it runs in (``tool_context``).

    Attributes:
        deadline: ``time.monotonic()`` at which the call's deadline (``env.tool_timeout_s``) passes, for a tool
            that must stop its own work before it (a sandbox run: ``reward.envs.python_tool``); None when the
            call has none (``run_tool_call`` outside ``run_with_tool_deadline``).
        sandbox: the env worker's ``reward.sandbox`` settings (a ``reward.config.SandboxConfig``), for tools that
            run model-written code (``SANDBOX_MARK``); None outside an env worker's ``step``.
    """

    deadline: float | None = None
    sandbox: Any = None


def tool_context() -> ToolContext:
    """The ``ToolContext`` of the tool call running in this thread; ``ToolContext()`` (no deadline, no sandbox
    settings) when there is none, or the tool runs without a deadline."""
    return getattr(_TOOL_CONTEXT, "value", None) or ToolContext()


def uses_sandbox(fn: Any) -> bool:
    """Whether tool ``fn`` (a function, bound method or staticmethod) is marked with ``SANDBOX_MARK``: it runs
    model-written code in ``reward.sandbox`` (the env worker then checks the sandbox works when it starts)."""
    return bool(getattr(getattr(fn, "__func__", fn), SANDBOX_MARK, False))


def needs_sandbox(env_cls: type | None, tools: Sequence[Callable] = ()) -> bool:
    """Whether ``tools`` (``env.tools``), or the ``@tool`` attributes of ``env_cls`` (``env.cls``), include one
    marked ``uses_sandbox``. A tool that reaches the sandbox only from inside another method is not seen."""
    if env_cls is not None:
        tools = [getattr(env_cls, name) for name in _tool_names(env_cls)]
    return any(uses_sandbox(fn) for fn in tools)


def _call_in_context(context: ToolContext, call: Callable[[], Any]) -> Any:
    """``call()`` with ``context`` as this thread's ``tool_context()`` (in the tool's own thread)."""
    _TOOL_CONTEXT.value = context
    try:
        return call()
    finally:
        _TOOL_CONTEXT.value = None


class ToolTimeout(BaseException):
    """A tool call ran past its deadline (``run_with_tool_deadline``). A ``BaseException``, so that a ``step``
    that catches ``Exception`` does not swallow it: it ends the episode with status ``timeout``."""


class ToolSchemaError(ValueError):
    """A tool cannot be described to the model: no docstring, an argument without a type hint or without an
    ``Args:`` line, a type ``get_json_schema`` cannot express, two tools of one name, or not callable."""


def tool(fn: Callable) -> Callable:
    """Mark a public method of an ``Environment`` subclass as a tool (``Environment.tools`` lists them).

    The function is returned unchanged (only marked). It needs type hints on every argument and a Google-style
    docstring with an ``Args:`` line per argument (checked when an episode starts: ``tool_schema``).

    Raises:
        ToolSchemaError: ``fn`` is not callable, or its name is private (starts with ``_``).
    """
    target = getattr(fn, "__func__", fn)
    name = getattr(target, "__name__", "")
    if not callable(target) or not name:
        raise ToolSchemaError(f"@tool needs a function, got {fn!r}")
    if name.startswith("_"):
        raise ToolSchemaError(f"@tool {name!r}: a tool's name is shown to the model and must be public (no leading _)")
    setattr(target, TOOL_MARK, True)
    return fn


@functools.lru_cache(maxsize=1024)
def _schema_of(target: Callable) -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(target)


def tool_schema(fn: Callable) -> dict:
    """The chat-template schema of one tool, ``{"type": "function", "function": {"name", "description",
    "parameters"}}`` (``transformers.utils.get_json_schema``; ``self`` of a method is left out). Cached per
    function; the caller gets its own copy.

    Raises:
        ToolSchemaError: the tool has no docstring, an argument lacks a type hint or an ``Args:`` description,
            or a hint cannot be expressed in JSON schema; the message names the tool and what is missing.
    """
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    if not callable(fn):
        raise ToolSchemaError(f"tool {fn!r} is not callable")
    target = getattr(fn, "__func__", fn)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    try:
        return copy.deepcopy(_schema_of(target))
    except (DocstringParsingException, TypeHintParsingException, NameError, TypeError, AttributeError) as err:
        raise ToolSchemaError(
            f"tool {name!r} has no usable schema: {err}. A tool needs a type hint on every argument and a "
            "Google-style docstring with an 'Args:' line for each (transformers.utils.get_json_schema)"
        ) from None


def tool_schemas(tools: Sequence[Callable]) -> list[dict]:
    """``tool_schema`` of each tool, in order.

    Raises:
        ToolSchemaError: as ``tool_schema``, or two tools share a name (the model calls tools by name).
    """
    schemas = [tool_schema(fn) for fn in tools]
    names = [s["function"]["name"] for s in schemas]
    doubles = sorted({n for n in names if names.count(n) > 1})
    if doubles:
        raise ToolSchemaError(f"tools {doubles} are defined more than once (tools are called by name)")
    return schemas


@functools.lru_cache(maxsize=256)
def _tool_names(cls: type) -> tuple[str, ...]:
    """The ``@tool`` names of ``cls`` in definition order, base classes first; an override without ``@tool``
    removes the name."""
    names: dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            if getattr(getattr(attr, "__func__", attr), TOOL_MARK, False):
                names[name] = None
            elif name in names:
                del names[name]
    return tuple(n for n in names if not n.startswith("_"))


def tool_error_text(text: str) -> str:
    """The text of an observation that tells the model its tool call failed: ``"Error: " + text``, at most
    ``OBSERVATION_ERROR_CHARS`` characters. Every such observation is written here: a tool call that failed
    (``run_tool_call``), one the parser could not read (``reward.env_worker.parse_error_message``, whose
    ``text`` is ``rollout.tool_calls.error_observation``'s description) and the example agents' tool calls
    (``reward.envs.calc_agent``, ``reward.envs.mcp_agent``)."""
    return f"Error: {text}"[:OBSERVATION_ERROR_CHARS]


def tool_error_message(text: str, name: str | None = None) -> dict:
    """``{"role": "tool", "content": tool_error_text(text)}``, with ``"name": name`` when a tool was named."""
    message = {"role": "tool", "content": tool_error_text(text)}
    if name is not None:
        message["name"] = name
    return message


def _tool_error(name: str | None, kind: str, text: str) -> tuple[dict, str]:
    return tool_error_message(text, name), kind


def run_with_tool_deadline(runner: DeadlineRunner, timeout_s: float, fn: Callable, *args: Any,
                           sandbox: Any = None) -> Any:
    """``fn(*args)``, with every tool that ``run_tool_call`` runs in this thread meanwhile run by ``runner``
    under a deadline of ``timeout_s`` seconds (the env worker wraps ``Environment.step`` in it). The tool's
    thread sees that deadline and ``sandbox`` (the worker's ``reward.sandbox`` settings) as ``tool_context()``.

    Raises:
        ToolTimeout: a tool call ran past the deadline (its thread is abandoned: ``reward.deadline``).
        Exception: whatever ``fn`` raises.
    """
    _TOOL_DEADLINE.value = (runner, timeout_s, sandbox)
    try:
        return fn(*args)
    finally:
        _TOOL_DEADLINE.value = None


def call_arguments(name: str, arguments: Any) -> dict:
    """A tool call's arguments as the tool's keyword arguments: a dict as it is, a JSON object in a string (the
    OpenAI wire form) parsed, None or a blank string ``{}``. The one reading of a call's arguments on the
    environment's side: ``run_tool_call`` (and so every ``Environment`` and OpenEnv's action), and the example
    agents' tool calls (``reward.envs.calc_agent``, ``reward.envs.mcp_agent``).

    Raises:
        ValueError: a string that is not valid JSON, or arguments that are not an object; the message names the
            tool ``name`` (it goes back to the model as a ``bad_arguments`` error).
    """
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"arguments of {name!r} are not valid JSON: {err}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"arguments of {name!r} must be an object, got {arguments!r}")
    return arguments


def run_tool_call(call: Any, tools_by_name: dict[str, Callable]) -> tuple[dict, str | None]:
    """One tool call as one observation message.

    Args:
        call: ``{"name": str, "arguments": dict}`` (``arguments`` may also be a JSON object as a string).
        tools_by_name: the episode's tools by name.

    Returns:
        ``(message, error kind or None)``. On success ``{"role": "tool", "name": name, "content":
        str(result)}``. Errors go back to the model as ``{"role": "tool", "name": name, "content": "Error:
        ..."}`` (at most ``OBSERVATION_ERROR_CHARS`` characters) with kind ``unknown_tool`` (no such tool, or a
        call without a string name), ``bad_arguments`` (arguments not an object, or not fitting the tool's
        signature) or ``raised`` (the tool raised: its exception type and message).

    Raises:
        ToolTimeout: under ``run_with_tool_deadline``, the tool ran past the deadline.
        reward.infra.InfraFailure: the tool raised it (a service it needs failed: the episode ends, scored by
            ``reward.on_infra_failure``, not the model's error).
        BaseException: outside it, what is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``).
    """
    name = call.get("name") if isinstance(call, dict) else None
    if not isinstance(name, str) or name not in tools_by_name:
        known = ", ".join(sorted(tools_by_name)) or "none"
        return _tool_error(name if isinstance(name, str) else None, "unknown_tool",
                           f"unknown tool {name!r}; the tools are: {known}")
    try:
        args = call_arguments(name, call.get("arguments"))
    except ValueError as err:
        return _tool_error(name, "bad_arguments", str(err))
    fn = tools_by_name[name]
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as err:
        return _tool_error(name, "bad_arguments", f"bad arguments for {name!r}: {err}")
    except ValueError:
        pass  # no signature to check (a builtin): the call itself will tell
    deadline = getattr(_TOOL_DEADLINE, "value", None)
    if deadline is None:
        try:
            result = fn(**args)
        except InfraFailure:  # a service the tool needs failed: the episode's, not the model's, to end
            raise
        except Exception as err:  # noqa: BLE001 - goes back to the model as an observation
            return _tool_error(name, "raised", f"{type(err).__name__}: {err}")
    else:
        runner, timeout_s, sandbox = deadline
        context = ToolContext(time.monotonic() + timeout_s, sandbox)
        out = runner.call(_call_in_context, context, functools.partial(fn, **args), timeout_s=timeout_s,
                          method=f"tool {name}")
        if out.status == "timeout":
            raise ToolTimeout(f"tool {name!r} did not return within {timeout_s:g} s (its thread is abandoned)")
        if out.status != "ok" and isinstance(out.value, InfraFailure):
            raise out.value
        if out.status != "ok":
            return _tool_error(name, "raised", f"{out.detail['error']}: {out.detail['message']}")
        result = out.value
    return {"role": "tool", "name": name, "content": str(result)}, None


@dataclass
class StepResult:
    """What ``Environment.step`` returns for one assistant turn.

    Attributes:
        messages: observation messages for the model, each ``{"role": str, "content": str}`` (tool results
            have role ``tool`` and the tool's ``name``); may be empty.
        done: the episode is over (no further assistant turn).
        reward: an optional per-turn reward (a finite float), reported to the driver beside the episode's
            reward; it is not added to it.
        tool_errors: how many of this turn's tool calls failed, by kind (``unknown_tool``, ``bad_arguments``,
            ``raised``: see ``run_tool_call``); for the metrics.
    """

    messages: list[dict]
    done: bool
    reward: float | None = None
    tool_errors: dict[str, int] = field(default_factory=dict)


class Environment:
    """The contract of a multi-turn environment: subclass it and name it as ``env.cls: module.path:Class``.

    One instance per episode, built as ``Env(row, seed)`` in an env worker, where ``row`` is the data row as a
    dict (``uid``, ``prompt``, ``answer``, ``verifier``, ``meta``) and ``seed`` an int. The G episodes of a
    group get the same row and the same seed, and must start in the same state: draw every random choice from
    ``seed`` (``random.Random(seed)``), never from global randomness or the clock.

    The worker calls, each under a deadline (``env.tool_timeout_s``) in a thread of its own:
    ``__init__``, ``initial_messages``, ``tools`` once at the start; ``step`` once per assistant turn (at most
    ``env.max_turns``) until it says ``done``; ``reward`` once at the end; ``close`` always, last, also after
    an error, a timeout or an abort (then possibly while a timed-out call is still running in its abandoned
    thread). Each tool call that ``step`` runs through ``call_tools`` / ``run_tool_call`` (the default
    ``step`` does) has a deadline of its own. An exception out of any of these methods, or a call or a tool
    call past its deadline, ends the episode (status ``error`` / ``timeout``, scored as ``env.on_error``
    says); a tool that raises inside ``call_tools`` does not: the model sees the error and carries on. A method
    or tool that raises ``reward.infra.InfraFailure`` (a service it needs failed: a lost connection, a server's
    timeout) ends the episode as the service's failure, scored by ``reward.on_infra_failure`` (invalid by
    default) instead.
    A subclass's constructor calls ``super().__init__(row, seed)`` first.

    Override what the default does not fit:

    - ``initial_messages() -> list[dict]``: the chat the episode starts from, ``{"role", "content"}`` dicts
      (str values). Default: the row's ``prompt`` as one user message.
    - ``tools() -> list[callable]``: the tools offered to the model, bound methods or functions with type
      hints and Google-style docstrings (their JSON schemas go to the chat template's ``tools=``). Default: the
      public methods marked ``@tool``, bound to this instance.
    - ``step(assistant_text, tool_calls) -> StepResult``: default: every call runs (``call_tools``), one
      ``{"role": "tool", "name": ..., "content": str(result)}`` message per call; done when the turn has no
      tool call (the model answered).
    - ``reward() -> float | dict[str, float]``: the episode's reward (required): a finite float, or named
      finite components whose **sum** is the reward (each component is logged).
    - ``close()``: release what the episode holds. Default: nothing.

    Attributes:
        row: the data row (dict).
        seed: the episode's seed (int; the same for the G episodes of a group).
    """

    def __init__(self, row: dict, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"{type(self).__name__}: seed must be an int, got {seed!r}")
        self.row = as_row_dict(row)
        self.seed = int(seed)

    def initial_messages(self) -> list[dict]:
        """The chat the episode starts from: ``[{"role": "user", "content": row["prompt"]}]`` by default.

        Raises:
            KeyError: the row has no ``prompt``.
        """
        return [{"role": "user", "content": str(self.row["prompt"])}]

    def tools(self) -> list[Callable]:
        """The tools offered to the model: the public ``@tool`` methods of this class, bound (definition order)."""
        return [getattr(self, name) for name in _tool_names(type(self))]

    def call_tools(self, tool_calls: list[dict]) -> tuple[list[dict], dict[str, int]]:
        """Run ``tool_calls`` in order against ``tools()`` (``run_tool_call``), for a ``step`` override.

        Returns:
            ``(one observation message per call, {error kind: count})``.
        """
        by_name = {getattr(fn, "__name__", str(fn)): fn for fn in self.tools()}
        messages: list[dict] = []
        errors: dict[str, int] = {}
        for call in tool_calls:
            message, kind = run_tool_call(call, by_name)
            messages.append(message)
            if kind is not None:
                errors[kind] = errors.get(kind, 0) + 1
        return messages, errors

    def step(self, assistant_text: str, tool_calls: list[dict]) -> StepResult:
        """One assistant turn: run its tool calls; done when it has none.

        Args:
            assistant_text: the turn's text as sampled (tool-call markup included).
            tool_calls: the parsed calls, ``[{"name": str, "arguments": dict}]``, in order.
        """
        messages, errors = self.call_tools(tool_calls)
        return StepResult(messages, done=not tool_calls, tool_errors=errors)

    def reward(self) -> float | dict[str, float]:
        """The episode's reward: a float, or ``{component: float}`` whose sum is the reward.

        Raises:
            NotImplementedError: always, here: every environment defines its reward.
        """
        raise NotImplementedError(f"{type(self).__name__}.reward() is not defined: an Environment returns the "
                                  "episode's reward (a float, or named float components that sum to it)")

    def close(self) -> None:
        """Release what the episode holds (called once, last, whatever happened). Default: nothing."""


class ToolsEnvironment(Environment):
    """The environment of ``env.tools``: given tool functions, and the row's verifier on the final answer.

    ``step`` is the default (tools run; done when the model answers without a tool call) and remembers the
    turn's text; ``reward`` is ``verifier(final assistant text, row)``, read the way the reward worker reads
    a verifier's result (``reward.worker.interpret``: a finite number, or a dict with one under ``score``).
    The tool functions are shared by every episode of the worker: state they keep in their module is shared
    too (use an ``Environment`` subclass for per-episode state).

    The verifier runs in the env worker under the call deadline (a thread), not in a killed child process as
    in the reward worker.

    Attributes:
        verifier: ``(response: str, row: dict) -> float | dict``.
        final_text: the last assistant turn's text ("" before the first).
    """

    def __init__(self, row: dict, seed: int, tools: Sequence[Callable], verifier: Callable[[str, dict], Any]):
        super().__init__(row, seed)
        self._tools = list(tools)
        self.verifier = verifier
        self.final_text = ""

    def tools(self) -> list[Callable]:
        """The configured tool functions."""
        return list(self._tools)

    def step(self, assistant_text: str, tool_calls: list[dict]) -> StepResult:
        """The default step, after noting ``assistant_text`` as the latest answer."""
        self.final_text = assistant_text
        return super().step(assistant_text, tool_calls)

    def reward(self) -> float:
        """The verifier's score of the final assistant text.

        Raises:
            ValueError: the verifier returned no finite number (``InvalidScore``); whatever the verifier raises.
        """
        from reward.config import RewardConfig
        from reward.runner import CallOutcome
        from reward.worker import interpret

        score, _, status, detail = interpret(CallOutcome("ok", self.verifier(self.final_text, self.row)),
                                             RewardConfig())
        if status != "ok":
            raise ValueError(f"{detail.get('error')}: {detail.get('message')}")
        return score


def episode_reward(value: Any) -> tuple[float, dict[str, float]]:
    """``(reward, components)`` of what ``Environment.reward`` returned: a finite real number (no components),
    or a non-empty ``{str: finite real}`` (the reward is the sum).

    Raises:
        ValueError: anything else (a bool, NaN or infinite value, an empty dict, a non-string key); the message
            shows the value.
    """
    def finite(v: Any) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

    if finite(value):
        return float(value), {}
    if isinstance(value, dict) and value and all(isinstance(k, str) and finite(v) for k, v in value.items()):
        components = {k: float(v) for k, v in value.items()}
        return math.fsum(components.values()), components
    raise ValueError(f"reward() must return a finite number or a non-empty dict of finite numbers by name, "
                     f"got {value!r}"[:OBSERVATION_ERROR_CHARS])


def resolve_user_object(name: str, key: str) -> Any:
    """The object ``"module.path:attr"`` names, its module imported (where ``python -m`` looks: ``sys.path``).

    Args:
        name: ``"module.path:attr"``.
        key: the config key that named it, for messages (``"env.cls"``).

    Raises:
        ValueError: ``name`` is not of that form, its module cannot be imported, or has no such attribute; the
            message names the key, the name and the module.
    """
    module, attr = import_user_module(name, f"{key}={name!r}")
    if not hasattr(module, attr):
        raise ValueError(f"{key}={name!r}: module {module.__name__!r} has no {attr!r}")
    return getattr(module, attr)


def load_environment_class(name: str, key: str = "env.cls") -> type[Environment]:
    """The ``Environment`` subclass ``"module.path:Class"`` names.

    Raises:
        ValueError: as ``resolve_user_object``, or it is not a subclass of ``Environment`` (or is
            ``Environment`` or ``ToolsEnvironment`` themselves, which need no class: use ``env.tools``).
    """
    cls = resolve_user_object(name, key)
    if not isinstance(cls, type) or not issubclass(cls, Environment):
        raise ValueError(f"{key}={name!r} is {cls!r}, not a subclass of reward.environment.Environment")
    if cls in (Environment, ToolsEnvironment):
        raise ValueError(f"{key}={name!r}: name your own subclass of Environment (for tools only, set env.tools)")
    return cls


def load_tools(names: Sequence[str], key: str = "env.tools") -> list[Callable]:
    """The tool functions ``["module.path:function", ...]`` name, their schemas checked.

    Raises:
        ValueError: as ``resolve_user_object`` (the key is ``env.tools[i]``), a name that is not callable, or
            a tool without a usable schema (``ToolSchemaError``, a ``ValueError``; the message names the key).
    """
    tools = []
    for i, name in enumerate(names):
        fn = resolve_user_object(name, f"{key}[{i}]")
        if not callable(fn) or isinstance(fn, type):
            raise ValueError(f"{key}[{i}]={name!r} is {fn!r}, not a function")
        try:
            tool_schema(fn)
        except ToolSchemaError as err:
            raise ToolSchemaError(f"{key}[{i}]={name!r}: {err}") from None
        tools.append(fn)
    tool_schemas(tools)
    return tools
