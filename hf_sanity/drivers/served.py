"""`hf-sanity served`: the model that is served against the model that was trained.

    report = hf_sanity.served(merged, base=base, adapter="out/adapter", tokenizer=tokenizer)

The trained model is the base with the saved adapter attached; the served one is what a server loads (the
merged model reloaded from disk). The adapter's own rules run too (saved empty, untrained, on the wrong base);
a vision-language model's folder is read for the processor a server needs beside it (`processor-not-saved`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from hf_sanity import catalog
from hf_sanity.errors import UserInputError
from hf_sanity.measure.saved import processor_beside, served_folder
from hf_sanity.measure.sources import as_dataset
from hf_sanity.report import Report
from hf_sanity.selection import resolve

SERVED_RULES = (
    "adapter-empty",
    "adapter-untrained",
    "adapter-base-mismatch",
    "adapter-not-loaded",
    "served-model-differs",
    "processor-not-saved",  # a vision-language model's folder: the processor a server needs beside it
    "image-settings-drift",  # ... and the serving processor's image settings against it
)
PROBE_ROWS = 8  # conversations the logits are compared on: any text tells two models apart


def served(
    model,
    *,
    base,
    adapter: str,
    tokenizer,
    dataset=None,
    sample: int = PROBE_ROWS,
    processor=None,
    select: str | Iterable[str] | None = None,
    ignore: str | Iterable[str] | None = None,
    use_config: bool = True,
) -> Report:
    """Check that ``model``, the served model object, computes what ``base`` + the saved ``adapter`` folder computed in
    training. ``dataset``: rows to compare the logits on (default: a few built-in conversations rendered with
    the tokenizer). The base model gets the adapter's layers for the duration of the check only. ``processor``:
    a vision-language model's serving processor (default: the one saved in ``tokenizer``'s folder, if any),
    compared with the one saved beside ``model`` (`image-settings-drift`)."""
    from hf_sanity.measure.context import Context
    from hf_sanity.measure.encode import EncodeOptions
    from hf_sanity.measure.formats import detect_format

    if sample < 1:
        raise UserInputError(f"--sample must be at least 1, got {sample}")
    selection = resolve(select, ignore, use_config=use_config).restricted(set(SERVED_RULES))
    started = time.perf_counter()
    data = as_dataset(dataset) if dataset is not None else probe_rows(tokenizer)
    fmt = detect_format(data.column_names, None, features=data.features)
    ctx = Context(
        tokenizer=tokenizer,
        dataset=data,
        fmt=fmt,
        options=EncodeOptions(fmt=fmt),
        model=base,
        adapter_path=str(adapter),
        served_model=model,
        sample=sample,
    )
    report = Report(title="hf-sanity served")
    report.extend(catalog.run_all("context", ctx, selection, stages=("model",)))
    folder = served_folder(model, serving_processor=processor or processor_beside(tokenizer))
    if folder is not None:
        report.extend(catalog.run_all("saved", folder, selection))
    comparison = vars(ctx).get("served")  # measured by the rules that read it (not when one before failed)
    report.stats.update(adapter=str(adapter), seconds=round(time.perf_counter() - started, 2))
    if comparison is not None:
        report.stats.update(
            max_logit_gap=comparison.served_vs_trained,
            embedding_rows_compared=min(comparison.embedding_rows),
        )
    return report


# The default rows the logits are compared on (``dataset`` replaces them): short conversations of the kinds
# people fine-tune on, one with a system turn and one with two exchanges, so that the chat template's markers
# and roles are in the batch too.
PROBE_CONVERSATIONS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("system", "You are a helpful assistant."), ("user", "What is the capital of France?"),
     ("assistant", "The capital of France is Paris.")),
    (("user", "What is 7 plus 5?"), ("assistant", "7 plus 5 is 12.")),
    (("user", "Please spell the word river backwards."), ("assistant", "The word river backwards is revir.")),
    (("user", "Write the number 4 in words."), ("assistant", "4 in words is four.")),
    (("user", "Name a colour of the sky."), ("assistant", "The sky is often blue."),
     ("user", "And at sunset?"), ("assistant", "At sunset it can be orange or red.")),
    (("user", "Summarise: the meeting moved to Tuesday at noon."), ("assistant", "The meeting is on Tuesday at noon.")),
    (("user", "Translate 'thank you' into French."), ("assistant", "'Thank you' in French is 'merci'.")),
    (("user", "Is 9 an even number?"), ("assistant", "No, 9 is an odd number.")),
)  # fmt: skip


def probe_rows(tokenizer):
    """:data:`PROBE_CONVERSATIONS` as a dataset (their text, for a tokenizer without a chat template)."""
    import datasets

    rows = [[{"role": role, "content": content} for role, content in turns] for turns in PROBE_CONVERSATIONS]
    if getattr(tokenizer, "chat_template", None):
        return datasets.Dataset.from_list([{"messages": messages} for messages in rows])
    return datasets.Dataset.from_list(
        [{"text": " ".join(m["content"] for m in messages)} for messages in rows]
    )
