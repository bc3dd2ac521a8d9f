"""A mixture of experts while it trains: the first step's load-balancing loss (`moe-aux-loss-off`) and where the
routers send the tokens of the probe batch (`expert-collapse`).

:class:`RouterMonitor` is fed ``routing`` once, at the first step (``measure.moe.aux_term``'s facts: who adds the
load-balancing loss, what the first forward returned, the coefficient), and ``router_load`` at the first batch
(per MoE layer: the share of experts with no token of the probe batch and the busiest expert's load over its
share, with the layer names and the probe's assignments per expert) and at each probe after it (the same two
numbers per layer). The measurement is `hf_sanity.training.routing`; the rules, `hf_sanity.rules.moe`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_sanity.catalog import monitor
from hf_sanity.findings import Finding
from hf_sanity.rules.moe import EXPERT_COLLAPSE, MOE_AUX_LOSS_OFF, aux_loss_off
from hf_sanity.rules.training.base import Monitor, TrainingSetup

DEAD_SHARE = 0.10  # experts with no token of the probe batch: above 10% of a layer's ...
DEAD_RISE = 0.10  # ... and 10 points (and two experts) more than at the first step
PEAK = 4.0  # the busiest expert's load over its equal share: above 4x ...
PEAK_RISE = 1.5  # ... and 1.5x what it was at the first step
# An expert overloaded past PEAK takes the slots of others: up to a quarter of a layer's experts going quiet with
# it is its consequence (the cause named is the overload); more is a collapse of its own (dead-experts).
STARVED = 0.25
MIN_IDEAL = 4.0  # assignments per expert on the probe batch, on average, below which a dead expert is chance
# A layer is judged collapsing at two probes in a row: one expert of a few tokens going quiet at one probe, on a
# fixed batch of a few hundred tokens, is noise (a clean fine-tune of the tiny MoE shows 1 -> 2 of 16).
CONFIRMING = 2


@monitor
class RouterMonitor(Monitor):
    rules = (MOE_AUX_LOSS_OFF, EXPERT_COLLAPSE)
    reads = ("routing", "router_load")

    def __init__(self) -> None:
        super().__init__()
        self.start: dict[str, Any] | None = None  # the first batch's load: layers, dead, peak, ideal, experts
        self.streak: dict[
            str, tuple[int, int]
        ] = {}  # layer -> (first probe step judged collapsing, probes since)

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> RouterMonitor:
        return cls()

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        found: list[Finding] = []
        if values.get("routing") is not None and MOE_AUX_LOSS_OFF.slug not in self.fired:
            finding = aux_loss_off(values["routing"], step=step)
            if finding is not None:
                self.fired.add(MOE_AUX_LOSS_OFF.slug)
                found.append(finding)
        load = values.get("router_load")
        if load is not None:
            found += self._load(step, load)
        return found

    def _load(self, step: int, load: Mapping[str, Any]) -> list[Finding]:
        if "layers" in load:  # a first batch's load: the probe batch it came with is the baseline
            self.start, self.streak = dict(load), {}
            return []
        start = self.start
        if start is None or start["ideal"] < MIN_IDEAL or len(load["peak"]) != len(start["peak"]):
            return []
        experts = int(start["experts"])
        rise = max(DEAD_RISE, 2.0 / experts - 1e-9)  # 10 points, and two experts at least
        hits, streak = [], {}
        for name, dead0, dead, peak0, peak in zip(
            start["layers"], start["dead"], load["dead"], start["peak"], load["peak"], strict=True
        ):
            dead_up = dead > DEAD_SHARE and dead - dead0 >= rise
            overloaded = peak > PEAK and peak >= PEAK_RISE * peak0
            if not (dead_up or overloaded):
                continue
            # up to a quarter, inclusive (4 of 16 experts), is the overload's consequence
            starved = dead_up and not (overloaded and dead - dead0 <= STARVED + 1e-9)
            first, probes = self.streak.get(name, (step, 0))
            streak[name] = since = (first, probes + 1)
            if since[1] >= CONFIRMING:
                hits.append(
                    {
                        "layer": name,
                        "since_step": since[0],
                        "dead_start": dead0,
                        "dead_now": dead,
                        "peak_start": peak0,
                        "peak_now": peak,
                        "dead_experts": round(dead * experts),
                        "cause": "dead-experts" if starved else "overloaded-expert",
                    }
                )
        self.streak = streak  # a layer that recovered starts over
        if not hits:
            return []
        worst = max(
            hits, key=lambda h: (h["cause"] == "dead-experts", h["dead_now"] - h["dead_start"], h["peak_now"])
        )
        return self.fire(
            EXPERT_COLLAPSE,
            f"since step {worst['since_step']} the router of {worst['layer']} sends {worst['peak_now']:.1f}x its "
            f"share to its busiest expert ({worst['peak_start']:.1f}x at the first step) and no token of the probe "
            f"batch to {worst['dead_experts']} of its {experts} experts ({worst['dead_start']:.0%} of them at the "
            f"first step); {len(hits)} of {len(start['layers'])} MoE layers",
            step=worst["since_step"],
            evidence={
                "layers": hits[:8],
                "layers_collapsing": len(hits),
                "moe_layers": len(start["layers"]),
                "experts": experts,
                "assignments_per_expert": start["ideal"],
                "confirmed_at_step": step,
                "cause": worst["cause"],
            },
        )
