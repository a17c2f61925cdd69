"""The rollout engine's turns of multi-turn episodes: one assistant turn per episode continuing its exact
token ids, as one batch (``sample_turns``) or continuously batched (``advance_turns``, ``abort_turns``).
A part of ``rollout.engine.RolloutEngine``.
"""

from __future__ import annotations

import time
from typing import Any

from rollout.contracts import SampledTurn, TurnRequest
from rollout.engine_base import EngineBase
from rollout.in_flight import merge_routing, output_counts, record_arrays, scheduler, token_versions


class TurnSampling(EngineBase):
    """``RolloutEngine``'s calls that sample episodes' turns."""

    def sample_turns(self, requests: list[TurnRequest], temperature: float | None = None) -> list[SampledTurn]:
        """Sample one assistant turn of each episode in ``requests``, continuing its exact token ids, as one batch
        that runs to its end (``advance_turns`` is the continuous-batching form the agent loop uses).

        ``SamplingParams(n=1, temperature, top_p=1, top_k=-1, logprobs=0, stop_token_ids=<every EOS id>,
        stop=request.stop, include_stop_str_in_output=True)``: the same post-temperature log-probs as
        ``generate``. The context goes in as token ids (never as text), so the ids trained on stay the ids sampled.
        Episodes that share a prefix (a group's prompt, an episode's earlier turns) reuse it from vLLM's prefix
        cache.

        Returns:
            One ``SampledTurn`` per request, in order, with this engine's current ``weight_version``.

        Raises:
            ValueError: temperature < 0 (0 samples greedy turns, for evaluation; their log-probs are those of
                the unscaled logits), a request with max_tokens < 1 or an empty context, or a context plus
                max_tokens past ``rollout.max_model_len``.
            RuntimeError: a weight sync is under way, turns of ``advance_turns`` are still open, or routing
                capture is on (an episode's routing per turn is not recorded).
        """
        self._check_no_open_turns("sample_turns")
        inputs, params = self._turn_inputs(requests, temperature)
        outputs = self._llm.generate(inputs, params, use_tqdm=False) if requests else []
        if self._routing_layers and requests:
            self._take_routing()
        return [self._turn(r, out) for r, out in zip(requests, outputs, strict=True)]

    def advance_turns(self, requests: list[TurnRequest], temperature: float | None = None,
                      slice_s: float = 0.05) -> tuple[list[SampledTurn], float]:
        """Continuous batching of episodes' turns: add ``requests`` to the turns already open on this engine, run
        vLLM's scheduler steps (``LLMEngine.step``) until at least one open turn has ended or ``slice_s`` seconds
        have passed, and return the turns that ended. The caller keeps one call in flight per engine and adds
        each episode's next turn as soon as its tool has answered, so the engine samples while tools run and a
        new turn joins the running batch at the next call, not after the whole batch. Sampling parameters,
        validation and log-probs are ``sample_turns``'s.

        Args:
            requests: turns to open (possibly none: then only the open ones advance).
            temperature: None = ``rollout.temperature``; 0 = greedy.
            slice_s: seconds after which the call returns even though no turn ended (>= 0).

        With ``sync.in_flight`` on (``set_in_flight``) a weight sync may open while turns are open; until it
        finishes this call adds ``requests`` but runs no step (the weights are half loaded) and returns
        ``([], 0.0)``. A turn that spans a load carries each token's version (``SampledTurn.token_versions``).

        Returns:
            ``(turns, busy_s)``: the turns that ended (in the order they ended) and the seconds spent in
            scheduler steps (the engine's busy time).

        Raises:
            ValueError, RuntimeError: as ``sample_turns`` (nothing is added when a request is refused); a
                request whose ``episode_id`` already has an open turn.
        """
        loading = self._load_open and self._in_flight != "off"
        inputs, params = self._turn_inputs(requests, temperature, during_load=loading)
        for r in requests:
            if r.episode_id in self._open_turns:
                raise ValueError(f"episode {r.episode_id}: a turn of it is already open on this engine")
        engine = self._llm.llm_engine
        for r, prompt, p in zip(requests, inputs, params):
            self._open_turns[r.episode_id] = (r, engine.add_request(r.episode_id, prompt, p))
            self._turn_marks[r.episode_id] = [(0, self._version)]
        if loading:
            return [], 0.0
        ended, busy, t0 = [], 0.0, time.perf_counter()
        while self._open_turns and not ended:
            t = time.perf_counter()
            ended += [out for out in engine.step() if out.finished]
            busy += time.perf_counter() - t
            if time.perf_counter() - t0 > slice_s:
                break
        done = [self._open_turns.pop(out.request_id) for out in ended]
        if self._routing_layers and done:  # each ended turn's routing, the running turns' kept for later
            self._take_turn_routings(done)
        return [self._turn(r, out) for (r, _), out in zip(done, ended)], busy

    def abort_turns(self) -> int:
        """Abort every open turn of ``advance_turns`` (the caller gave up on its episodes); returns how many."""
        return self.drop_turns(list(self._open_turns))[0]

    def drop_turns(self, episode_ids: list[str]) -> tuple[int, int]:
        """Abort the open turns of ``episode_ids`` (ids with no open turn here are skipped: their turn may have
        ended in a call the caller has not read yet). Returns ``(turns aborted, sampled tokens thrown away)``; the
        tokens are counted with ``sync.in_flight`` on (vLLM's scheduler in this process), else 0."""
        ids = [e for e in episode_ids if e in self._open_turns]
        if not ids:
            return 0, 0
        rids = [self._open_turns[e][1] for e in ids]
        tokens = 0
        if self._in_flight != "off":
            tokens = sum(output_counts(scheduler(self._llm), dict(zip(ids, rids))).values())
        self._llm.llm_engine.abort_request(ids)
        if self._routing_layers:  # their partial routings: dropped
            self._llm.collective_rpc("rollout_take_routing", args=(rids,))
        for e in ids:
            del self._open_turns[e]
            self._turn_marks.pop(e, None)
            self._routing_heads.pop(e, None)
        return len(ids), tokens

    def _take_turn_routings(self, done: list[tuple[TurnRequest, str]]) -> None:
        """Index the routings of the turns in ``done`` (request, vLLM id). A turn open across an in-flight load
        has its routing from before the load (``_routing_heads``): merged (``rollout.in_flight.merge_routing``)
        and kept for its own ``get`` only; with ``recompute`` the record after the load (every position
        recomputed under the new weights) is also the donor of later prefix hits on that KV."""
        records = self._llm.collective_rpc("rollout_take_routing", args=([rid for _, rid in done],))[0]
        episode = {rid: r.episode_id for r, rid in done}
        plain = []
        for rec in records:
            head = self._routing_heads.pop(episode.get(rec["request"], ""), None)
            if head is None or self._in_flight == "recompute":
                plain.append(rec)
            if head is not None:
                tokens, ids = merge_routing(head, record_arrays(rec))
                if len(ids) and (ids[:, 0, 0] >= 0).all() and (tokens >= 0).all():
                    self._routing.put_final(tokens, ids)
                else:
                    self._routing.unresolved += 1
        self._routing.add(plain)

    def _turn_inputs(self, requests: list[TurnRequest], temperature: float | None,
                     during_load: bool = False) -> tuple[list[Any], list[Any]]:
        """vLLM's token prompts and sampling parameters of ``requests`` (``sample_turns``), after its checks
        (``during_load``: an in-flight load is under way, which these requests wait for)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._syncing and not during_load:
            raise RuntimeError("engine is between weight versions (a weight sync did not finish): no sampling")
        temperature = self.cfg.temperature if temperature is None else float(temperature)
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy turns, for evaluation)")
        limit = self.cfg.max_model_len
        for r in requests:
            if r.max_tokens < 1 or not r.context_ids or len(r.context_ids) + r.max_tokens > limit:
                raise ValueError(f"episode {r.episode_id}: {len(r.context_ids)} context tokens and max_tokens="
                                 f"{r.max_tokens} must be >= 1 each and fit rollout.max_model_len={limit}")
        params = [SamplingParams(n=1, temperature=temperature, top_p=1.0, top_k=-1, max_tokens=r.max_tokens,
                                 logprobs=0, stop_token_ids=self.stop_token_ids, stop=list(r.stop) or None,
                                 include_stop_str_in_output=True, seed=r.seed) for r in requests]
        return [TokensPrompt(prompt_token_ids=list(r.context_ids)) for r in requests], params

    def take_token_records(self) -> tuple[list[tuple[str, int, int, int, str]], int]:
        """The token check's records of the turns this engine sampled since the last call (``sample_turns``,
        ``advance_turns``; aborted turns have none), and how many were dropped for room (``rollout.
        token_records``): ``([(episode_id, branch, context_len, sampled_len, digest)], lost)``, oldest first. The
        context is the prompt vLLM ran (its ``prompt_token_ids``), the digest ``rollout.token_records.turn_digest``.
        The driver drains them once per step (docs/agents.md "The token check")."""
        return self._token_records.take()

    def _turn(self, request: TurnRequest, out: Any) -> SampledTurn:
        sample = out.outputs[0]
        token_ids = list(sample.token_ids)
        if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
            raise RuntimeError(f"episode {request.episode_id}: vLLM returned no log-prob for some sampled tokens")
        ran = out.prompt_token_ids if out.prompt_token_ids is not None else request.context_ids
        self._token_records.add(request.episode_id, request.branch, ran, token_ids)
        marks = self._turn_marks.pop(request.episode_id, None)
        versions = token_versions(marks, len(token_ids)) if marks else []
        spans = len(set(versions)) > 1
        return SampledTurn(
            episode_id=request.episode_id, token_ids=token_ids,
            logprobs=[float(step[tok].logprob) for tok, step in zip(token_ids, sample.logprobs, strict=True)],
            text=sample.text, finish_reason="length" if sample.finish_reason == "length" else "stop",
            stop_reason=sample.stop_reason, weight_version=min(versions) if versions else self._version,
            token_versions=versions if spans else None, routed_experts=self._turn_routing(request, token_ids) if self._routing_layers else None)

    def _turn_routing(self, request: TurnRequest, token_ids: list[int]) -> Any:
        """The engine routing of an episode up to this turn: int16 ``[C + T - 1, layers, k]`` for the context's
        ``C`` and the turn's ``T`` ids; the positions of earlier turns and replies come from the forwards that
        computed their KV (the prefix cache's donors, ``RoutingStore``), so each sampled token keeps its own
        turn's experts."""
        try:
            return self._routing.get(list(request.context_ids) + token_ids)
        except KeyError as e:
            raise RuntimeError(f"episode {request.episode_id}: rollout.return_routed_experts=true but the engine "
                               f"recorded no complete routing for this turn ({e.args[0]})") from None
