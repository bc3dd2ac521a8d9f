"""What SanityCallback measures of a mixture of experts, for `hf_sanity.rules.training.moe`: at the first batch,
the routers (found once) and whether the loss carries the load-balancing term (``routing``: decided by a TRL
trainer when it was built, else read from what the first training forward returned); and, riding on the probe
forwards the callback runs anyway (the step-0 probe and the predictions probe, `hf_sanity.training.probe`),
where the routers send the probe batch's tokens (``router_load``). The router hooks only count: one scatter
per MoE layer on the device, no synchronisation, no extra forward.

A hook that fails inside a probe's forward keeps its exception for :meth:`RouterWatch.counted` to report under
`expert-collapse`'s own guard: the probe itself, and the checks that read it, go on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from hf_sanity.measure import moe

COLLAPSE_RULE = "expert-collapse"
AUX_RULE = "moe-aux-loss-off"
# What it measures (the values RouterMonitor reads): measured when an enabled step detector reads them.
MEASURED = ("routing", "router_load")


class RouterWatch:
    def __init__(self) -> None:
        self.routers: moe.Routers | None = None
        self.looked = False  # the model was looked at (a dense model: nothing to do from then on)
        self.pending = None  # (trainer, model) until the first forward's output says what it returned
        self.load: moe.Load | None = None  # the last probe's, until pushed
        self.sink = None

    def look(self, model, sink) -> bool:
        """Find the routers of ``model`` once; whether it has any."""
        if not self.looked:
            self.looked, self.sink = True, sink
            if sink.measures(*MEASURED):
                with sink.guard(COLLAPSE_RULE):
                    self.routers = moe.routers_of(model)
        return self.routers is not None

    @contextlib.contextmanager
    def counted(self, model, batch: Mapping[str, Any], sink=None) -> Iterator[None]:
        """Where the routers send the tokens of the probe forward run inside the block (kept for
        :meth:`first_values` and :meth:`push`); nothing for a dense model or when `expert-collapse` is off.
        ``sink``: the callback's (given at the first batch, kept for the probes after it)."""
        self.load = None
        sink = sink or self.sink
        if sink is None or not self.look(model, sink) or not sink.measures("router_load"):
            yield
            return
        failed: list[Exception] = []
        with moe.routed(self.routers, batch.get("attention_mask"), failed=failed) as load:
            yield
        with sink.guard(COLLAPSE_RULE):
            if failed:
                raise failed[0]
            self.load = load[0] if load else None

    def first_values(self, model, trainer, sink, *, rl: bool) -> dict[str, Any]:
        """At the first batch: the step-0 load, and the load-balancing facts when the trainer decides them (TRL);
        otherwise they wait for the first forward's output (not on an RL run: its first forward generates)."""
        if not self.look(model, sink):  # a dense model: looked at, nothing to watch
            return {"routing": None} if sink.measures(*MEASURED) else {}
        values: dict[str, Any] = {}
        with sink.guard(COLLAPSE_RULE):
            if self.load is not None:
                values["router_load"] = self.load.plain()
                self.load = None
        if sink.measures("routing"):
            with sink.guard(AUX_RULE):
                facts = moe.aux_term(trainer, model)
                if facts is not None and facts["decided_by"] == "trainer":
                    values["routing"] = facts
                elif facts is not None and not rl:
                    self.pending = (trainer, model)
        return values

    def after_first_forward(self, output) -> dict[str, Any]:
        """The load-balancing facts of a model that adds the term itself: what its first forward returned."""
        if self.pending is None or self.sink is None:
            return {}
        trainer, model = self.pending
        self.pending = None
        with self.sink.guard(AUX_RULE):
            return {"routing": moe.aux_term(trainer, model, moe.returned_aux(output))}
        return {}

    def push(self, recorder, step: int) -> None:
        """A probe's load into the recorder, one value per MoE layer, on the device until the next read."""
        load, self.load = self.load, None
        if load is None or self.sink is None:
            return
        with self.sink.guard(COLLAPSE_RULE):
            for dead, peak in zip(load.dead, load.peak, strict=True):
                recorder.push(step, "router_dead", dead)
                recorder.push(step, "router_peak", peak)
