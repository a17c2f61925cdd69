"""The number-guessing agent task (``data.task: agent_guess``): find a secret number in ``1..data.guess_high``
from ``higher`` / ``lower`` replies, in as few guesses as possible.

The environment is ``reward.envs.guess_number:GuessNumber`` (``env.cls``); every row's ``meta`` configures it:
``low`` 1, ``high`` ``data.guess_high``, ``use_prompt`` (the first message is the row's short prompt,
``"Guess my number in 1..9."``, so the episode's first ids are the row's prompt ids in plain mode) and
``guess_bonus`` (``data.guess_bonus``: a found number scores ``1 + guess_bonus x (guesses saved against trying
every number)``, so fewer guesses are better and a found number is still ``correct``). A turn is one guess in
the ``tag`` format, ``<call>guess 5</call>``, answered ``<result>lower</result>`` (``rollout.tool_calls``,
``rollout.chat_delta``'s plain rendering); the episode ends with ``correct``.

Training rows draw their secret from the episode's seed (a group shares it); held-out rows fix it
(``meta["secret"]``), cycling through the whole range, so the greedy episodes' mean turns is the mean over every
secret alike. Optimal play (binary search) needs about log2(range) guesses: for 1..9, 2.78 on average and 4 at
most; trying 1, 2, 3, ... needs 5 on average and 9 at most.

The warm start's demonstrations (``meta["solution_turns"]``: every guess and its reply up to ``correct``, for a
secret drawn with ``data.seed``) are deliberately inefficient in a share ``data.demo_slip_rate`` of the rows:
those scan linearly (1, 2, 3, ... up to the secret), the others play binary search (the lower middle of the
numbers still possible, ``(lo + hi) // 2``: 5, then 2 or 7, ...). Both are consistent with the replies, and the
first guess tells them apart (1 or 5), so the warm-started model picks a strategy with its first guess and plays
it out; with a rate above 0.5 its greedy choice is the scan (5 turns on average). The reward for saved guesses
makes binary search better, so RL can cut the turns.
"""

from __future__ import annotations

import random

from rollout.contracts import PromptRow

TOOL = "guess"
LOW = 1


def guess_prompt(low: int, high: int) -> str:
    """The row's prompt, which is also the episode's first message (``GuessNumber``'s ``use_prompt``)."""
    return f"Guess my number in {low}..{high}."


def guess_turns(secret: int, low: int, high: int, scan: bool) -> list[list[str]]:
    """A demonstration of one game: ``[["assistant", "<call>guess G</call>"], ["tool", reply], ...]`` up to the
    guess answered ``correct`` (the episode ends there: no turn follows it). With ``scan`` every guess is the
    lowest number still possible (``low``, ``low + 1``, ...), else the middle of the numbers still possible
    (``(lo + hi) // 2``: binary search); either way every guess is consistent with the replies before it.

    Raises:
        ValueError: ``secret`` outside ``[low, high]``.
    """
    if not low <= secret <= high:
        raise ValueError(f"secret={secret} is outside [{low}, {high}]")
    turns: list[list[str]] = []
    lo, hi = low, high
    while True:
        g = lo if scan else (lo + hi) // 2
        turns.append(["assistant", f"<call>{TOOL} {g}</call>"])
        if g == secret:
            return turns  # the environment says done after "correct": the demonstration ends on the call
        if g < secret:
            turns.append(["tool", "higher"])
            lo = g + 1
        else:
            turns.append(["tool", "lower"])
            hi = g - 1


def agent_guess_rows(tokenize, *, high: int, num_train: int, num_eval: int, seed: int, demo_slip_rate: float = 0.0,
                     guess_bonus: float = 0.0) -> tuple[list[PromptRow], list[PromptRow]]:
    """``num_train`` training rows (the secret from the episode's seed; each with a demonstration for a secret
    drawn with ``seed``: a linear scan with probability ``demo_slip_rate``, else binary search, ``guess_turns``)
    and ``num_eval`` held-out rows whose secrets cycle through ``1..high`` (``meta["secret"]``). All rows share
    one prompt (``guess_prompt``); ``tokenize`` encodes it.

    Raises:
        ValueError: ``high`` < 2, or a negative ``guess_bonus``.
    """
    if high < LOW + 1:
        raise ValueError(f"data.guess_high={high} must be >= {LOW + 1} (a game needs two numbers)")
    if guess_bonus < 0:
        raise ValueError(f"data.guess_bonus={guess_bonus} must be >= 0")
    prompt = guess_prompt(LOW, high)
    ids = list(tokenize(prompt))
    game = {"low": LOW, "high": high, "use_prompt": True, "guess_bonus": guess_bonus}
    rng = random.Random(seed)
    train = []
    for i in range(num_train):
        secret, scan = rng.randint(LOW, high), rng.random() < demo_slip_rate
        train.append(PromptRow(uid=f"train/{i}", prompt=prompt, prompt_token_ids=list(ids), answer="",
                               meta={**game, "solution_turns": guess_turns(secret, LOW, high, scan)}))
    held_out = []
    for i in range(num_eval):
        secret = LOW + i % (high - LOW + 1)
        held_out.append(PromptRow(uid=f"eval/{i}", prompt=prompt, prompt_token_ids=list(ids), answer=str(secret),
                                  meta={**game, "secret": secret}))
    return train, held_out
