"""SanityCallback's train begin, part by part: the run's world and objective, the model-side sampler, the rank
exchange, the monitors, the objective's own feed, a resumed run's state, the setup values and the instruments.

Each part runs in its own guard (tests/test_architecture.py checks that no statement runs outside one): a part
that breaks is one internal-error finding and leaves out only what needs it, never the run, and never the
parts after it (an optimizer the sampler cannot read still leaves the curves, the first batch and the TRL
metrics watched).
"""

from __future__ import annotations

from pathlib import Path

from hf_sanity import versions
from hf_sanity.measure.frameworks import trainer_facts
from hf_sanity.measure.objective import of_trainer
from hf_sanity.training import outcome, resume
from hf_sanity.training.instrument import find_trainer, move_before_reporters
from hf_sanity.training.measures import StepSampler
from hf_sanity.training.monitors import MonitorSet
from hf_sanity.training.ranks import RankExchange, world
from hf_sanity.training.trl_metrics import ObjectiveFeed


def watch(callback, args, state, model=None, optimizer=None) -> None:
    """Set ``callback`` up to watch the run Trainer is starting (``model``/``optimizer``: the event's)."""
    sink = callback.sink
    with sink.guard("callback-setup"):  # first and alone: every rank must agree on the world size
        sink.is_main = bool(state.is_world_process_zero)
        outcome.begin(state)
        callback.trainer = find_trainer()
        sink.narrow(of_trainer(callback.trainer))
        sink.rank, sink.world_size = world()
    with sink.guard("callback-setup"):  # the trainer watched, and the framework that built it
        if callback.trainer is not None:
            sink.report.stats["trainer"] = trainer_facts(callback.trainer)
    with sink.guard("callback-setup"):  # a library outside the versions supported: one note each
        sink.report.notes.extend(versions.check())
    with sink.guard("callback-setup"):
        callback.model = getattr(callback.trainer, "model", None) or model
        sink.output_dir = Path(args.output_dir or ".") / "hf-sanity"
        sink.annotate = lambda finding: callback.held.attach(finding, sink.save_batch)
    with sink.guard("callback-setup"):  # what the run starts from: doctor tells two runs' starts apart by it
        if sink.is_main and state.global_step == 0 and callback.model is not None:
            from hf_sanity.measure.tensors import start_fingerprint

            sink.report.stats["start_weights"] = start_fingerprint(callback.model)
    with sink.guard("callback-sampler"):  # the model-side measurements: the rest runs without them
        callback.sampler = StepSampler(
            callback.trainer, callback.model, optimizer or getattr(callback.trainer, "optimizer", None), args,
            state, sink.measures, check_every=callback.check_every, world_size=sink.world_size,
        )  # fmt: skip
    sampler = callback.sampler
    with sink.guard("callback-sync"):
        compared = sampler.sharding.replicated if sampler is not None else None
        callback.exchange = RankExchange(sink.rank, sink.world_size, compared=compared)
    with sink.guard("callback-monitors"):
        setup = sampler.training_setup(sink.world_size, sink.objective) if sampler is not None else None
        callback.monitors = MonitorSet(sink, setup)
    with sink.guard("callback-trl-metrics"):
        callback.trl = ObjectiveFeed(callback.trainer, sink, callback.probe_every, callback.reward_dry_run)
    with sink.guard("resume"):
        callback.resumed = resume.begin(
            callback, state
        )  # a resumed run continues from the checkpoint's state
    with sink.guard("callback-setup-values"):
        if sampler is not None:
            callback.monitors.feed(0, sampler.setup_values())
    with sink.guard("callback-trl-metrics"):
        callback.monitors.feed(0, callback.trl.begin())
    with sink.guard("callback-instruments"):
        callback.instruments.install(callback.trainer, callback.model, callback)
        move_before_reporters(callback.trainer, callback)
    with sink.guard("memory-growth"):
        callback._memory_check(0)  # the baseline the growth is measured from
