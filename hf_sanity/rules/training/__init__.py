"""Training rules: per-step signals of a running Trainer, each detected by a plain Monitor (a "step" detector)
that SanityCallback feeds and tests drive with numbers.

=====================  =========================================================================
module                 rules
=====================  =========================================================================
``loss``               nonfinite-loss (and its cause), negative-loss, loss-plateau-prior
``gradients``          nonfinite-grad, grad-explosion, stale-gradients
``updates``            loss-flat, lr-zero, lr-too-low; no-trainable-params, optimizer-missing-params
``mode``               train-mode-off
``memory``             memory-growth, oom
``ranks``              ranks-diverged
``predictions``        predictions-frozen
``shapes``             shape-mismatch
=====================  =========================================================================

What the callback measures for them (torch, hooks, collectives) lives in `hf_sanity.training`.
"""
