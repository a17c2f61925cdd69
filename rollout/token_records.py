"""The engine's record of the turns it sampled, for the token check (docs/agents.md "The token check").

Per episode turn an engine samples, it keeps what the request conditioned on and what it sampled, compactly: the
episode id and branch, the context's and the turn's lengths, and a digest of both id sequences
(``turn_digest``). The driver drains the records once per step (``RolloutEngine.take_token_records``) and compares
them with what the learner ranks trained (``learner.token_digests`` recomputes the same digest from the trained
rows); a turn trained on ids the engine never conditioned on or sampled shows up as a digest the engines never
produced (``agent/token_mismatch``).

The digest is a stable spec, written twice on purpose (here and in ``learner/token_digests.py``, the services
share no code; a unit test holds them equal): BLAKE2b with a 16-byte digest over the context's length, the context
ids and the sampled ids, each as little-endian int32 bytes (so the split between context and turn is part of it).
The two lengths are kept beside it, for the reader.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import Sequence

import numpy as np

#: records an engine keeps between two drains; older ones are dropped and counted (``TokenRecords.lost``)
MAX_RECORDS = 200_000


def turn_digest(context_ids: Sequence[int], sampled_ids: Sequence[int]) -> str:
    """The digest of one turn: BLAKE2b (16 bytes, hex) of ``len(context_ids)``, ``context_ids`` and
    ``sampled_ids``, each as little-endian int32 bytes (ids must fit int32)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray([len(context_ids)], dtype="<i4").tobytes())
    h.update(np.asarray(context_ids, dtype="<i4").tobytes())
    h.update(np.asarray(sampled_ids, dtype="<i4").tobytes())
    return h.hexdigest()


class TokenRecords:
    """A bounded buffer of turn records: ``(episode_id, branch, context_len, sampled_len, digest)`` tuples.

    Args:
        max_records: records kept until the next ``take``; past it the oldest are dropped and counted in ``lost``.
    """

    def __init__(self, max_records: int = MAX_RECORDS):
        self._records: deque[tuple[str, int, int, int, str]] = deque(maxlen=max_records)
        self.lost = 0

    def add(self, episode_id: str, branch: int, context_ids: Sequence[int], sampled_ids: Sequence[int]) -> None:
        """Record one sampled turn of ``episode_id`` (its ``branch``) on ``context_ids``."""
        if len(self._records) == self._records.maxlen:
            self.lost += 1
        self._records.append((episode_id, int(branch), len(context_ids), len(sampled_ids),
                              turn_digest(context_ids, sampled_ids)))

    def take(self) -> tuple[list[tuple[str, int, int, int, str]], int]:
        """The records since the last ``take`` (oldest first) and how many were dropped for room; both reset."""
        out, lost = list(self._records), self.lost
        self._records.clear()
        self.lost = 0
        return out, lost
