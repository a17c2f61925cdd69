"""MoE routing: forward hooks on the routers, expert-load and routing-volatility statistics, Routing Replay.

Why these exist (GSPO, Zheng et al., arXiv 2507.18071, section 5.3): in a Mixture-of-Experts policy the
experts a token is routed to change after every gradient update (the paper measures about 10% of the
activated experts changing per update on a 48-layer model). Token-level importance ratios then compare two
different sub-networks and become noisy; GRPO on MoE needs *Routing Replay* (reuse the behaviour policy's
expert choices when computing the current policy's log-probs), GSPO does not.

Mechanism. ``RouterTap`` registers one forward hook on every router module of a transformers MoE model (the
class that transformers itself records ``router_logits`` from: ``model._can_record_outputs["router_logits"]``,
e.g. ``Qwen3MoeTopKRouter`` in transformers 5.19). Such a router returns ``(router_logits [N, E],
routing_weights [N, k], selected_experts [N, k])`` for the ``N = batch x seq`` tokens of one forward; the
experts module runs ``selected_experts`` weighted by ``routing_weights``. The hook reads ``selected_experts``
(transformers' ``output_router_logits`` would only give the logits) and, for Routing Replay, returns a
replacement output. Hooks only see module outputs, so they work unchanged under DeepSpeed ZeRO 1/2/3 (under
ZeRO-3 the sparse MoE block is a leaf module whose parameters are gathered around the whole block, router
included). Outside a ``capture`` context the hooks return nothing and the forward is untouched.

Limitations: the tap assumes one router call per MoE layer and forward, in layer order (true for
transformers' decoder stacks). With activation checkpointing the backward's recomputed forward runs outside the
capture context: it records nothing (diagnostics stay right) but would route without replay, so Routing Replay
and ``learner.gradient_checkpointing`` are refused together.

Pure torch apart from the model object: no Ray, DeepSpeed or config imports.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = [
    "RouterTap",
    "RoutingRecord",
    "find_routers",
    "expert_counts",
    "load_statistics",
    "topk_set_changes",
    "response_positions",
    "load_metrics",
    "volatility_metrics",
    "rollout_replay_ids",
    "renormalises_topk",
    "ALWAYS_RENORMALISE",
]


def _router_class(model: nn.Module) -> type | None:
    recorders = getattr(type(model), "_can_record_outputs", None) or {}
    rec = recorders.get("router_logits") if isinstance(recorders, dict) else None
    target = getattr(rec, "target_class", None)
    return target if isinstance(target, type) else None


def find_routers(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """The router modules of a transformers MoE model, in forward order.

    A router is an instance of the class transformers records ``router_logits`` from
    (``type(model)._can_record_outputs["router_logits"].target_class``), or, when the model declares none, a
    module whose class name ends in ``TopKRouter``.

    Returns:
        ``[(layer_index, module_name, module), ...]``; ``layer_index`` is the decoder layer number parsed from
        ``...layers.<L>...`` in the module name (the position in the list when the name has none). Empty for a
        dense model.
    """
    cls = _router_class(model)
    found = []
    for name, module in model.named_modules():
        if (cls is not None and isinstance(module, cls)) or (cls is None and type(module).__name__.endswith("TopKRouter")):
            found.append((name, module))
    out = []
    for pos, (name, module) in enumerate(found):
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        out.append((int(m.group(1)) if m else pos, name, module))
    return out


class RoutingRecord:
    """What one forward's routers did, filled in by ``RouterTap.capture``.

    Attributes:
        used: per MoE layer (forward order), ``[N, k]`` integer expert ids the experts module ran for each of
            the forward's ``N = batch x seq`` tokens (row-major over ``[batch, seq]``): the router's own choice,
            or the replayed one.
        router: per MoE layer, ``[N, k]``: the router's own top-k choice (equal to ``used`` without replay).
        replay: the ``[layers, N, k]`` ids being replayed, or None.
    """

    __slots__ = ("used", "router", "replay", "_dtype")

    def __init__(self, replay: Tensor | None, dtype: torch.dtype):
        self.used: list[Tensor] = []
        self.router: list[Tensor] = []
        self.replay = replay
        self._dtype = dtype

    def used_tensor(self) -> Tensor:
        """``[layers, N, k]`` (compact integer dtype, detached) of ``used``."""
        return torch.stack(self.used) if self.used else torch.zeros((0, 0, 0), dtype=self._dtype)

    def router_tensor(self) -> Tensor:
        """``[layers, N, k]`` of ``router``."""
        return torch.stack(self.router) if self.router else torch.zeros((0, 0, 0), dtype=self._dtype)


class RouterTap:
    """Forward hooks on every router of ``model``: record the experts chosen per token and layer, and
    optionally replace them (Routing Replay).

    Routing Replay (``capture(replay=ids)``): the router's logits are computed as usual at the current weights,
    but the experts run are the recorded ``ids`` and their gating weights are the current router's softmax
    probabilities gathered at those experts, renormalised over them when the router renormalises its top-k
    (``renormalises_topk``: Qwen3-MoE's ``norm_topk_prob=True``, Mixtral always), i.e. exactly the router's own
    formula with the expert choice replaced, in the dtype of the router's own gating weights (Qwen3-MoE casts
    them to the logits' dtype, Mixtral keeps float32); the first replayed forward of each router checks that
    this formula gives the router's own gates at its own choice (RuntimeError otherwise). Why: this keeps the
    forward a differentiable function of the current router (the router still learns, and its gradient has the
    same form as without replay), and when the current router would pick the same experts the output is
    bit-identical to a forward without replay (same values, same summation order), so replay changes nothing
    but the expert choice. This is the GSPO paper's Routing Replay (section 5.3:
    cache the activated experts of the old policy and apply them in the current policy's forward when
    computing the importance ratios).

    Args:
        model: a transformers model (the module DeepSpeed wraps: ``engine.module``).

    Attributes:
        layers: decoder layer index of each router, in forward order. Empty for a dense model.
        num_experts, top_k: of the routers (the first router's; all are checked to agree).

    Raises:
        ValueError: routers with different expert counts or top-k.
    """

    def __init__(self, model: nn.Module):
        routers = find_routers(model)
        self.layers = [layer for layer, _, _ in routers]
        self.names = [name for _, name, _ in routers]
        self._modules = [m for _, _, m in routers]
        self.num_experts = int(getattr(self._modules[0], "num_experts", 0)) if routers else 0
        self.top_k = int(getattr(self._modules[0], "top_k", 0)) if routers else 0
        for name, m in zip(self.names, self._modules):
            if int(getattr(m, "num_experts", -1)) != self.num_experts or int(getattr(m, "top_k", -1)) != self.top_k:
                raise ValueError(f"router {name} has a different num_experts/top_k than {self.names[0]}")
        self.index_dtype = torch.int16 if self.num_experts < (1 << 15) else torch.int32
        self._active: RoutingRecord | None = None
        self._calls = 0
        self._gates_checked: set[int] = set()  # router positions whose gates the formula was checked against
        self._handles = [m.register_forward_hook(self._hook) for m in self._modules]

    @property
    def is_moe(self) -> bool:
        """True when the model has at least one router."""
        return bool(self._modules)

    @property
    def can_replay(self) -> bool:
        """True when the model has routers and every one has a ``top_k`` and a known top-k renormalisation
        (``renormalises_topk`` is not None), the two things the replay formula needs."""
        return self.is_moe and all(hasattr(m, "top_k") and renormalises_topk(m) is not None for m in self._modules)

    def remove(self) -> None:
        """Remove the hooks (the model is then exactly as before)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextmanager
    def capture(self, replay: Tensor | None = None) -> Iterator[RoutingRecord]:
        """Record (and with ``replay`` replace) the routing of exactly one forward of the model.

        Args:
            replay: None, or ``[layers, N, k]`` integer expert ids (as recorded by an earlier capture of a
                forward over the same tokens) to run instead of the router's own choice.

        Yields:
            A ``RoutingRecord``, filled in when the forward ran.

        Raises:
            RuntimeError: the forward called the routers a different number of times than there are MoE
                layers, a replay tensor of the wrong shape, a router whose output is not
                ``(logits, weights, experts)``, or a nested capture.
            ValueError: ``replay`` given but the routers do not support it (``can_replay`` is False).
        """
        if self._active is not None:
            raise RuntimeError("RouterTap.capture is not re-entrant")
        if replay is not None:
            if not self.can_replay:
                raise ValueError(f"Routing Replay needs routers with top_k and a known top-k renormalisation "
                                 f"(norm_topk_prob, or one of {ALWAYS_RENORMALISE}); got {type(self._modules[0]).__name__}")
            if replay.dim() != 3 or replay.shape[0] != len(self._modules) or replay.shape[2] != self.top_k:
                raise RuntimeError(
                    f"replay ids have shape {tuple(replay.shape)}, expected [{len(self._modules)}, N, {self.top_k}]"
                )
        record = RoutingRecord(replay, self.index_dtype)
        self._active, self._calls = record, 0
        try:
            yield record
        finally:
            self._active = None
        if self._calls != len(self._modules):
            raise RuntimeError(f"the forward called {self._calls} routers, expected {len(self._modules)}")

    def _hook(self, module: nn.Module, args, output):
        record = self._active
        if record is None:
            return None
        if not (isinstance(output, tuple) and len(output) == 3):
            raise RuntimeError(f"router {type(module).__name__} returned {type(output).__name__}, expected "
                               "(router_logits, routing_weights, selected_experts)")
        logits, weights, chosen = output
        layer = self._calls
        self._calls += 1
        own = chosen.detach().to(self.index_dtype)
        record.router.append(own)
        if record.replay is None:
            record.used.append(own)
            return None
        forced = record.replay[layer].to(device=chosen.device, dtype=torch.long)
        if tuple(forced.shape) != tuple(chosen.shape):
            raise RuntimeError(
                f"replay ids for router {layer} have shape {tuple(forced.shape)}, the router chose {tuple(chosen.shape)}"
            )
        # The router's own formula (softmax in float32, gather the chosen experts, renormalise over them when the
        # router does), with the expert choice replaced, in the dtype of the router's own gating weights.
        renorm = bool(renormalises_topk(module))
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        if layer not in self._gates_checked:  # once per router: a property of its class, and a host sync on GPUs
            _check_gate_formula(module, probs, weights, chosen, renorm)
            self._gates_checked.add(layer)
        top = probs.gather(-1, forced)
        if renorm:
            top = top / top.sum(dim=-1, keepdim=True)
        record.used.append(forced.detach().to(self.index_dtype))
        return logits, top.to(weights.dtype), forced


# Router classes that renormalise their top-k gates in every forward and have no ``norm_topk_prob`` switch:
# transformers 5.19's ``MixtralTopKRouter`` divides its top-k softmax probabilities by their sum unconditionally
# (Mixtral, Jiang et al. 2024, arXiv 2401.04088, eq. 2: softmax over the top-k logits, which is the same thing).
ALWAYS_RENORMALISE = ("MixtralTopKRouter",)


def renormalises_topk(router: nn.Module) -> bool | None:
    """Whether ``router`` renormalises its top-k softmax probabilities to sum to 1 before gating.

    Returns:
        ``router.norm_topk_prob`` when it has one (Qwen3-MoE, Qwen2-MoE, OLMoE); True for a class in
        ``ALWAYS_RENORMALISE`` (Mixtral); None when unknown (Routing Replay is then refused: ``can_replay``).
    """
    if hasattr(router, "norm_topk_prob"):
        return bool(router.norm_topk_prob)
    if type(router).__name__ in ALWAYS_RENORMALISE:
        return True
    return None


def _check_gate_formula(module: nn.Module, probs: Tensor, weights: Tensor, chosen: Tensor, renorm: bool) -> None:
    """Raise RuntimeError when the replay formula applied to the router's OWN choice does not give the router's
    own gating weights (a router class whose gating the formula does not describe): replay would then change
    the forward beyond the expert choice. Tolerance: 1e-5 plus two units of the weights' dtype."""
    own = probs.detach().gather(-1, chosen.long())
    if renorm:
        own = own / own.sum(dim=-1, keepdim=True)
    tol = 1e-5 + 2 * torch.finfo(weights.dtype).eps
    gap = float((own - weights.detach().float()).abs().max()) if own.numel() else 0.0
    if gap > tol:
        raise RuntimeError(f"router {type(module).__name__}: its gating weights differ by {gap:.3g} from softmax -> "
                           f"top-k{' -> renormalise' if renorm else ''}; Routing Replay cannot reproduce it")


# -------------------------------------------------------------------------------------------------------------
# statistics (pure functions)


def response_positions(mask: Tensor) -> Tensor:
    """Router token positions whose hidden state produces a response token's log-prob.

    Args:
        mask: bool ``[b, w-1]`` response mask over the targets ``input_ids[:, 1:]`` of a ``[b, w]`` forward.

    Returns:
        bool ``[b * w]``, row-major over ``[b, w]``: True at input position ``t`` of row ``i`` when
        ``mask[i, t]`` (position ``t`` predicts target ``t + 1``); the last column is never selected.
    """
    pad = torch.zeros((mask.shape[0], 1), dtype=torch.bool, device=mask.device)
    return torch.cat([mask.bool(), pad], dim=1).reshape(-1)


def expert_counts(ids: Tensor, select: Tensor, num_experts: int) -> Tensor:
    """Routed (token, top-k slot) assignments per layer and expert.

    Args:
        ids: integer ``[layers, N, k]`` expert ids.
        select: bool ``[N]``, the tokens to count.
        num_experts: ``E``.

    Returns:
        float64 ``[layers, E]``: ``counts[l, e]`` = number of (selected token, slot) pairs routed to ``e`` in
        layer ``l``; each row sums to ``k x selected tokens``.
    """
    layers = ids.shape[0]
    out = torch.zeros((layers, num_experts), dtype=torch.float64)
    if layers == 0:
        return out
    chosen = ids[:, select.to(ids.device)].long().reshape(layers, -1).cpu()
    out.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=torch.float64))
    return out


def load_statistics(counts: Tensor) -> dict[str, object]:
    """Expert-load shares and imbalance figures from ``expert_counts`` (summed over micro-batches and ranks).

    With ``share[l, e] = counts[l, e] / sum_e counts[l, e]`` (each layer's shares sum to 1; mean share
    ``1/E``): ``imbalance[l] = max_e share[l, e] / mean_e share[l, e] = E max_e share[l, e]`` (1 = perfectly
    even, ``E / k`` = every token on the same k experts); ``cv[l] = std_e share / mean_e share`` (population
    std; 0 = even). Layers without any counted token have share 0, imbalance 1 and cv 0.

    Args:
        counts: float ``[layers, E]``.

    Returns:
        ``{"share": list of lists [layers][E], "imbalance": list [layers], "cv": list [layers],
        "imbalance_mean", "imbalance_max", "cv_mean": floats}`` (means over layers; 1.0/1.0/0.0 without layers).
    """
    counts = counts.double()
    layers, experts = counts.shape
    tot = counts.sum(-1, keepdim=True)
    share = torch.where(tot > 0, counts / tot.clamp_min(1), 0.0)
    mean = 1.0 / max(experts, 1)
    imb = torch.where(tot[:, 0] > 0, share.max(-1).values / mean, 1.0) if experts else torch.ones(layers)
    cv = torch.where(tot[:, 0] > 0, share.std(-1, unbiased=False) / mean, 0.0) if experts else torch.zeros(layers)
    return {
        "share": share.tolist(),
        "imbalance": imb.tolist(),
        "cv": cv.tolist(),
        "imbalance_mean": float(imb.mean()) if layers else 1.0,
        "imbalance_max": float(imb.max()) if layers else 1.0,
        "cv_mean": float(cv.mean()) if layers else 0.0,
    }


def topk_set_changes(a: Tensor, b: Tensor, select: Tensor) -> tuple[int, int]:
    """How many (token, layer) top-k expert SETS differ between two routings of the same tokens.

    Order within the top-k does not matter (the sets are compared after sorting).

    Args:
        a, b: integer ``[layers, N, k]``.
        select: bool ``[N]``, the tokens to compare.

    Returns:
        ``(changed, compared)``: differing (token, layer) pairs, and ``layers x selected tokens``.

    Raises:
        ValueError: ``a`` and ``b`` of different shapes.
    """
    if a.shape != b.shape:
        raise ValueError(f"routings of shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be compared")
    sel = select.to(a.device)
    sa = a[:, sel].sort(-1).values
    sb = b[:, sel].to(a.device).sort(-1).values
    changed = int((sa != sb).any(-1).sum())
    return changed, int(sa.shape[0] * sa.shape[1])


def load_metrics(counts: torch.Tensor, layers: list[int]) -> dict[str, object]:
    """Expert-load metrics from the all-reduced ``[layers, E]`` counts of the pre-update pass (``layers``: the
    decoder layer numbers of the MoE layers, ``RouterTap.layers``).

    Counted: every (token, top-k slot) routing decision at the input positions whose output predicts a
    response token (``learner.moe.response_positions``), over all ranks and minibatches of the step.
    ``moe/expert_load[l][e]``: share of layer ``l``'s assignments that went to expert ``e`` (rows sum to 1;
    ``l`` indexes the MoE layers in order, ``moe/layers`` gives their decoder layer numbers);
    ``moe/layer{L}/load_imbalance``: max share / mean share (1 = even, E/k = collapsed);
    ``moe/load_imbalance``: mean over layers, ``moe/load_imbalance_max``: the worst layer;
    ``moe/load_cv``: mean over layers of the coefficient of variation of the shares.
    """
    stats = load_statistics(counts)
    out: dict[str, object] = {
        "moe/load_imbalance": stats["imbalance_mean"],
        "moe/load_imbalance_max": stats["imbalance_max"],
        "moe/load_cv": stats["cv_mean"],
    }
    for layer, imb in zip(layers, stats["imbalance"]):
        out[f"moe/layer{layer}/load_imbalance"] = imb
    out["moe/expert_load"] = stats["share"]
    out["moe/layers"] = list(layers)
    return out

def volatility_metrics(vol_tot: list[list[float]], vol_updates: list[int]) -> dict[str, float]:
    """Routing volatility of the step from the all-reduced per-pass counts.

    What it measures: take the experts every response position (see ``load_metrics``) was routed to in
    each MoE layer during the pre-update forward (the behaviour policy when the rollout is on-policy: the
    weights the rollout was generated with). Every later training forward over the same tokens (minibatch
    ``m`` of epoch ``e`` runs after ``u = e * M + m`` optimizer steps of this call) is compared with it; a
    (token, layer) pair counts as changed when its top-k expert SET differs (order ignored). Passes with
    ``u = 0`` (the first minibatch of the first epoch: same weights) are left out.

    - ``moe/routing_volatility``: mean over the measured passes of changed / compared (pairs pooled over
      ranks, tokens and layers within a pass), for the experts the training forward actually USED (0
      under Routing Replay by construction);
    - ``moe/routing_volatility_unreplayed``: the same for the router's OWN top-k choice at the current
      weights (what it would pick without replay; equal to the above without replay);
    - ``moe/routing_volatility_per_update``: mean over the passes of (router's own changed share) / u, a
      per-update rate comparable across num_minibatches (the paper's "about 10% per update");
    - ``moe/routing_volatility_passes``: number of measured passes (0 with one minibatch and one epoch:
      the three figures are then 0 and mean nothing).
    """
    shares_used = [c[0] / c[2] for c in vol_tot if c[2] > 0]
    shares_own = [c[1] / c[2] for c in vol_tot if c[2] > 0]
    per_update = [c[1] / c[2] / u for c, u in zip(vol_tot, vol_updates) if c[2] > 0]
    n = len(shares_used)
    return {
        "moe/routing_volatility": sum(shares_used) / n if n else 0.0,
        "moe/routing_volatility_unreplayed": sum(shares_own) / n if n else 0.0,
        "moe/routing_volatility_per_update": sum(per_update) / n if n else 0.0,
        "moe/routing_volatility_passes": float(n),
    }


def rollout_replay_ids(routes: Tensor, top_k: int) -> Tensor:
    """R3 replay ids of one micro-batch from the engine's routing (``TrainBatch.rollout_routes``).

    Args:
        routes: int16 ``[b, w, layers, k]``, -1 where the engine ran no expert (padding, each row's last token).
        top_k: the learner routers' ``k``.

    Returns:
        int16 ``[layers, b * w, k]`` (row-major over ``[b, w]``, the layout ``RouterTap.capture(replay=...)``
        takes). Positions without an engine routing get experts ``0 .. k-1``: they are right padding or a row's
        last token, whose hidden states no response log-prob depends on (causal attention), so any valid choice
        gives the same loss.

    Raises:
        ValueError: ``routes`` not 4-D with last dimension ``top_k``.
    """
    if routes.dim() != 4 or routes.shape[-1] != top_k:
        raise ValueError(f"rollout routes have shape {tuple(routes.shape)}, expected [b, w, layers, {top_k}] (the "
                         "engine's top-k differs from the learner's?)")
    b, w, layers, k = routes.shape
    ids = routes.permute(2, 0, 1, 3).reshape(layers, b * w, k)
    missing = (ids < 0).any(-1, keepdim=True)
    fill = torch.arange(k, dtype=ids.dtype).expand_as(ids)
    return torch.where(missing, fill, ids)
