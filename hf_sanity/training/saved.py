"""SanityCallback at each save: the checkpoint the Trainer just wrote, read for what a server needs beside the
weights (`hf_sanity.measure.saved`), judged by the `saved` detectors (the sink reports a rule once: the first
checkpoint that lacks it)."""

from __future__ import annotations

from hf_sanity import catalog
from hf_sanity.measure.saved import last_checkpoint, read_saved
from hf_sanity.measure.vision import measure_modality


def on_save(callback, args, state, control, **kwargs):
    """``SanityCallback.on_save``: Trainer calls it after each checkpoint it writes."""
    with callback.sink.guard("processor-not-saved"):
        check_last_checkpoint(callback, args, state)
    return control


def check_last_checkpoint(callback, args, state) -> None:
    """The checkpoint of ``state.global_step``: only the main process reads it, and only a checkpoint this run
    wrote (none when it saved none: nothing to judge)."""
    if not callback.sink.is_main or not getattr(args, "output_dir", None):
        return
    folder = last_checkpoint(args.output_dir, state.global_step)
    if folder is None:
        return
    trainer = callback.trainer
    processing_class = getattr(trainer, "processing_class", None)
    modality = measure_modality(processing_class, getattr(trainer, "model", None) or callback.model)
    if not modality.is_vision:
        return
    subject = read_saved(folder, state.global_step, modality, processing_class)
    callback.sink.emit(catalog.run_all("saved", subject, callback.selection, step=state.global_step))
