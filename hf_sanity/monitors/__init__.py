"""Plain monitors behind `SanityCallback`: each is fed numbers step by step
(``monitor.update(step, values) -> list[Finding]``) and holds the thresholds and verdicts of one family of
training rules. Tests drive them with numbers; the callback only measures and forwards.

=====================  =========================================================================
module                 rules
=====================  =========================================================================
``loss``               nonfinite-loss (cause from ``nonfinite``), negative-loss, loss-plateau-prior
``gradients``          nonfinite-grad, grad-explosion, stale-gradients
``updates``            loss-flat, lr-zero, lr-too-low; no-trainable-params, optimizer-missing-params
``mode``               train-mode-off
``memory``             memory-growth, oom
``ranks``              ranks-diverged
``probe``              predictions-frozen (and the step-0 probe for init-loss-off-chance)
``first_batch``        shape-mismatch, and preflight's token rules on the first real batch
=====================  =========================================================================
"""

from hf_sanity.monitors.base import Monitor
from hf_sanity.monitors.gradients import GradientMonitor
from hf_sanity.monitors.loss import LossMonitor
from hf_sanity.monitors.memory import MemoryMonitor
from hf_sanity.monitors.mode import TrainModeMonitor
from hf_sanity.monitors.probe import PredictionsMonitor
from hf_sanity.monitors.ranks import RankMonitor
from hf_sanity.monitors.recorder import EarlyFlags, Recorder
from hf_sanity.monitors.updates import UpdateMonitor

__all__ = [
    "EarlyFlags",
    "GradientMonitor",
    "LossMonitor",
    "MemoryMonitor",
    "Monitor",
    "PredictionsMonitor",
    "RankMonitor",
    "Recorder",
    "TrainModeMonitor",
    "UpdateMonitor",
]
