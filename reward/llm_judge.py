"""An LLM judge as a reward: the judge's prompt for a sample, its score parsed from the answer, and the score
joined with the verifiers' (config ``reward.judge``, ``reward.config.JudgeConfig``).

Plain functions, no Ray and no vLLM: the judge's engines are ``rollout.judge_engine.JudgeEngine`` actors that the
driver starts and calls (``cluster/runtime/judge.py``). Not to be confused with ``reward/judge.py``, the judge of
assert-style code tests.

A failed judgement is never an exception past this module's callers: every parse returns NaN with a status
(``"unparsed"``, ``"error"``, ``"timeout"``), and ``combine`` makes the sample's reward NaN, the project's mark
of an invalid sample (``RewardResult.valid``: advantage 0, left out of its group's statistics). A judge whose
engine failed (raised, died, past its deadline) is a service's failure (``reward.infra``, ``judge_failed``):
marked and counted as such, scored by ``reward.on_infra_failure``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import string
from dataclasses import dataclass, field
from typing import Any

from reward.contracts import RewardResult
from reward.infra import DETAIL_KEY, detail_cause, infra_score

#: The row fields a template may name (besides ``{meta[KEY]}``).
TEMPLATE_FIELDS = ("prompt", "answer", "response", "uid")

_META = re.compile(r"meta\[([^\[\]]+)\]")


def template_fields(template: str) -> list[str]:
    """The fields ``template`` names, in order: ``prompt``, ``answer``, ``response``, ``uid`` or ``meta[KEY]``.

    Raises:
        ValueError: a positional field (``{}``, ``{0}``), attribute access (``{prompt.x}``), another name, or a
            malformed template (an unmatched brace); the message names ``reward.judge.template`` and the field.
    """
    names = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ValueError(f"reward.judge.template={template[:80]!r}: {err} (write {{{{ and }}}} for literal braces)"
                         ) from None
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if name not in TEMPLATE_FIELDS and not _META.fullmatch(name):
            raise ValueError(f"reward.judge.template: field {{{name}}} is not one of "
                             f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)} or {{meta[KEY]}}")
        names.append(name)
    return names


def render(template: str, row: Any, response: str) -> str:
    """The judge's message for one sample: ``template`` with the row's ``prompt``, ``answer``, ``uid``, its meta
    fields (``{meta[KEY]}``) and the ``response`` filled in (values inserted as text, never re-parsed).

    Args:
        template: a template ``template_fields`` accepts.
        row: a ``rollout.contracts.PromptRow`` or its dict.
        response: the sampled response text.

    Raises:
        ValueError: a bad template (``template_fields``), or a ``{meta[KEY]}`` the row's meta does not have
            (names the key and the row's uid).
    """
    template_fields(template)
    r = dataclasses.asdict(row) if dataclasses.is_dataclass(row) and not isinstance(row, type) else dict(row)
    meta = r.get("meta") or {}

    def value(name: str) -> str:
        m = _META.fullmatch(name)
        if m is None:
            return response if name == "response" else str(r.get(name, ""))
        if m.group(1) not in meta:
            raise ValueError(f"reward.judge.template names {{meta[{m.group(1)}]}}, which row uid={r.get('uid')!r} "
                             f"does not have (its meta keys: {sorted(meta)})")
        return str(meta[m.group(1)])

    out = []
    for literal, name, spec, conv in string.Formatter().parse(template):
        out.append(literal)
        if name is not None:
            text = value(name)
            if conv:
                text = {"r": repr, "s": str, "a": ascii}[conv](text)
            out.append(format(text, spec) if spec else text)
    return "".join(out)


def prompt_ids(tokenizer: Any, text: str, *, system_prompt: str | None = None, chat: bool = True) -> list[int]:
    """Token ids of the judge's prompt: ``text`` as the user message (after ``system_prompt``) through the
    tokenizer's chat template with the generation prompt when ``chat`` and the tokenizer has a template;
    otherwise ``text`` (after ``system_prompt`` and a blank line) encoded as it is, with the tokenizer's
    special tokens (a BOS where it adds one).

    Args:
        tokenizer: a Hugging Face tokenizer (``transformers.AutoTokenizer``).

    Returns:
        list of int token ids, non-empty.

    Raises:
        ValueError: the prompt encodes to no token.
    """
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        ids = [int(t) for t in ids]
    else:
        ids = [int(t) for t in tokenizer.encode((system_prompt + "\n\n" if system_prompt else "") + text)]
    if not ids:
        raise ValueError("the judge prompt encodes to no token")
    return ids


def single_token_ids(tokenizer: Any, names: list[str], key: str) -> list[int]:
    """The token id of each string in ``names``, each of which must be exactly one token of ``tokenizer``
    (encoded without special tokens); repeats are dropped.

    Raises:
        ValueError: a string that is not one token (names ``key``, the string and its tokens).
    """
    out: list[int] = []
    for name in names:
        ids = tokenizer.encode(name, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{key}: {name!r} is {len(ids)} tokens of the judge's tokenizer ({ids}), not one; name "
                             "single tokens (a leading space is often its own form: ' Yes')")
        if ids[0] not in out:
            out.append(int(ids[0]))
    return out


def parse_regex(answer: str, pattern: str, scale: float = 1.0) -> float:
    """The score in a judge's ``answer``: the first match of ``pattern`` (``re.search``), its first group (or
    the whole match when it has none) as a float, times ``scale``. NaN when nothing matches or the text is not a
    finite number."""
    m = re.search(pattern, answer)
    if m is None:
        return math.nan
    text = m.group(1) if m.re.groups else m.group(0)
    try:
        value = float(text) * scale
    except (TypeError, ValueError):
        return math.nan
    return value if math.isfinite(value) else math.nan


def parse_token_probs(top_logprobs: dict[int, float], positive: list[int], negative: list[int]) -> float:
    """``P(positive) / (P(positive) + P(negative))`` at one position, each side the sum of ``exp(logprob)`` over its
    token ids found among ``top_logprobs`` (a token outside the top log-probs counts 0).

    Args:
        top_logprobs: token id -> natural-log probability at the judge's first generated position.
        positive, negative: token ids (disjoint).

    Returns:
        a float in [0, 1]; NaN when no positive or negative token is among ``top_logprobs``.
    """
    p = sum(math.exp(top_logprobs[t]) for t in positive if t in top_logprobs)
    n = sum(math.exp(top_logprobs[t]) for t in negative if t in top_logprobs)
    return p / (p + n) if p + n > 0 else math.nan


@dataclass
class Judgement:
    """The judge's verdict on one sample.

    Attributes:
        score: the parsed score (float), NaN when the judge failed.
        status: ``"ok"``, ``"unparsed"`` (an answer without a score), ``"timeout"``, ``"error"`` (the engine
            failed or died, or the prompt could not be built) or ``"skipped"`` (not asked: the gate was closed).
        answer: the judge's answer text (cut to 200 characters).
        detail: the error's name and message for a failure.
    """

    score: float
    status: str = "ok"
    answer: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


def judgement(answer: str, top_logprobs: dict[int, float], cfg: Any, positive: list[int],
              negative: list[int]) -> Judgement:
    """The ``Judgement`` of one engine answer under ``cfg`` (``reward.judge``): the regex or token-probability
    score, ``"unparsed"`` with NaN when there is none."""
    if cfg.score == "regex":
        value = parse_regex(answer, cfg.regex, cfg.scale)
    else:
        value = parse_token_probs(top_logprobs, positive, negative)
    return Judgement(value, "ok" if math.isfinite(value) else "unparsed", answer[:200])


def combine(result: RewardResult, judged: Judgement, mode: str, weight: float,
            on_infra_failure: str = "invalid") -> RewardResult:
    """The reward of one sample from the verifiers' ``result`` and the judge's ``judged``.

    ``weighted``: ``result.score + weight * judged.score``. ``gate``: the same when ``result.correct``, else
    ``result.score`` (the judge's verdict is not used; it is ``"skipped"`` when it was not asked). A judgement
    that counts and failed (NaN) makes the reward NaN, status ``"error"`` or ``"timeout"``; when its engine
    failed (``judged.detail["infra"]``: ``judge_failed``) the sample is the service's failure:
    ``infra_failed`` set and the reward ``on_infra_failure``'s (``reward.on_infra_failure``: NaN for
    ``invalid``, 0 for ``zero``). ``correct`` stays the verifier's; ``detail["judge"]`` holds the judge's score
    and status.

    Raises:
        ValueError: an unknown ``mode`` or ``on_infra_failure``.
    """
    if mode not in ("weighted", "gate"):
        raise ValueError(f"reward.judge.combine.mode={mode!r} must be 'weighted' or 'gate'")
    detail = {**result.detail, "judge": {"score": judged.score, "status": judged.status, **judged.detail}}
    if mode == "gate" and not result.correct:
        return dataclasses.replace(result, detail=detail)
    total = result.score + weight * judged.score
    status, cause = result.status, result.infra_failed
    if not math.isfinite(judged.score) and status == "ok":
        status = "timeout" if judged.status == "timeout" else "error"
        total = math.nan
        cause = detail_cause(judged.detail) or ""
        if cause:
            total, detail[DETAIL_KEY] = infra_score(on_infra_failure), cause
    return dataclasses.replace(result, score=float(total), status=status, detail=detail, infra_failed=cause)
