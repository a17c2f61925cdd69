"""What the rollout engine's parts share: the state ``RolloutEngine.__init__`` sets (declared here, so each
part names what it reads) and the two checks more than one part makes, routing capture's hand-over and the
open turns of continuous batching.

The parts are ``rollout/engine_sampling.py`` (grouped sampling, greedy completions, prompt log-probs),
``rollout/engine_turns.py`` (episodes' turns, continuous batching) and ``rollout/engine_weights.py`` (weight
updates in place); ``rollout/engine.py``'s ``RolloutEngine`` is all of them on one vLLM ``LLM``.
"""

from __future__ import annotations

from typing import Any

from rollout.config import RolloutConfig
from rollout.contracts import TurnRequest
from rollout.routing_capture import RoutingStore
from rollout.token_records import TokenRecords


class EngineBase:
    """The state of one rollout engine that its parts share (set by ``RolloutEngine.__init__``)."""

    cfg: RolloutConfig
    model_path: str
    stop_token_ids: list[int]
    _llm: Any
    _version: int
    _syncing: bool
    _routing: RoutingStore
    _routing_layers: list[int]
    _checkpoint_names: set[str] | None
    _tied_embeddings: bool
    _open_turns: dict[str, tuple[TurnRequest, str]]
    _load_open: bool  # between start_weight_update and its finish (or its failure)
    _in_flight: str  # sync.in_flight: "off" (a sync needs no open turn), "keep" or "recompute"
    _routing_heads: dict[str, tuple[Any, Any]]  # R3: open turn -> its routing recorded before an in-flight load
    _turn_marks: dict[str, list[tuple[int, int]]]  # open turn -> [(first token index, version)] (rollout.in_flight)
    _token_records: TokenRecords

    def _take_routing(self) -> None:
        self._routing.add(self._llm.collective_rpc("rollout_take_routing")[0])

    def routing_stats(self) -> dict[str, int]:
        """Routing capture since the last weight sync: ``filled_positions`` (positions served from the prefix
        cache whose experts came from the request that computed them) and ``unresolved`` (records with no such
        request; a completion among them fails with an error). Zeros when capture is off."""
        return {"filled_positions": self._routing.filled_positions, "unresolved": self._routing.unresolved}

    def _check_no_open_turns(self, what: str) -> None:
        if self._open_turns:
            raise RuntimeError(f"{what}: {len(self._open_turns)} turns of advance_turns are still open on this "
                               f"engine (finish them or abort_turns first)")
