"""`outputs()`: held-out prompts -> greedy generations, measured once -> every `outputs` detector -> one report.

What the fine-tuned model actually says: it renders each held-out prompt with the chat template the model is
served with, generates greedily in left-padded batches (seeded, on the model's device), and checks the
generations: never stopping, stray template markers, echoing the prompt, repetition loops, answers cut short,
outputs identical to the base model's, and the generation config's stop tokens. A vision-language model's
folder is read for the processor a server needs beside it (`processor-not-saved`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from pathlib import Path

from hf_sanity import catalog
from hf_sanity.errors import UserInputError
from hf_sanity.measure.formats import check_alpaca_template
from hf_sanity.measure.generate import DEFAULT_BATCH_SIZE, DEFAULT_MAX_NEW_TOKENS
from hf_sanity.measure.objective import KINDS, of_columns
from hf_sanity.measure.saved import processor_beside, served_folder
from hf_sanity.measure.sources import as_dataset
from hf_sanity.report import Report
from hf_sanity.selection import resolve

DEFAULT_PROMPTS = 32


def check_options(
    *,
    n: int = DEFAULT_PROMPTS,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    alpaca_template: str | None = None,
    objective: str | None = None,
) -> None:
    """The numbers and choices of `outputs`, checked before anything is loaded."""
    check_alpaca_template(alpaca_template)
    if objective is not None and objective not in KINDS[:-1]:
        raise UserInputError(f"--objective must be one of {', '.join(KINDS[:-1])}, got {objective!r}")
    for name, value in (("--n", n), ("--max-new-tokens", max_new_tokens), ("--batch-size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserInputError(f"{name} must be a positive integer, got {value!r}")


def check_adapter_folder(adapter: str | Path) -> None:
    """A saved PEFT adapter folder, readable (or one line saying what is wrong)."""
    from hf_sanity.drivers.load import check_adapter

    check_adapter(adapter)


def outputs(
    model=None,
    tokenizer=None,
    dataset=None,
    *,
    adapter: str | Path | None = None,
    base=None,
    inference_tokenizer=None,
    generation_config=None,
    n: int = DEFAULT_PROMPTS,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    format: str | None = None,
    alpaca_template: str | None = None,
    objective: str | None = None,
    reward_funcs=None,
    train_reward=None,
    seed: int = 0,
    processor=None,
    select: str | Iterable[str] | None = None,
    ignore: str | Iterable[str] | None = None,
    use_config: bool = True,
) -> Report:
    """Generate for ``n`` held-out prompts of ``dataset`` and check what the model says; a :class:`Report`.

    ``model``: the fine-tuned model (a PEFT model, a merged one, or a base model with ``adapter=``, a saved
    adapter folder attached for the run and removed after). ``tokenizer``: its tokenizer; the prompts are
    rendered with ``inference_tokenizer``'s chat template when given (the one you serve with), else with
    ``tokenizer``'s. ``generation_config``: how the model is served (default: the model's own); generation is
    greedy whatever it says, and stops on its ``eos_token_id``, the tokenizer's EOS and the template's end of
    turn. ``base``: the base model, to compare outputs with (``adapter-no-effect``); pass the very ``model``
    object (a PEFT model, or a base model with ``adapter=``) to compare with and without the adapter. ``dataset``: conversations
    (``messages``, ShareGPT ``conversations``), ``prompt``/``completion`` rows (or ``prompt`` alone), Alpaca
    rows, preference pairs (their chosen answer the reference); the prompt side of each row is what is sent, its
    last answer the reference. ``objective``: what the model was trained for (`measure.objective.KINDS`; default:
    read from the dataset's columns); after preference or RL training, ``policy-drift`` compares it with
    ``base``. ``reward_funcs``: after RL, the reward functions (called as TRL calls them, on copies, with a time
    limit) scored on the held-out generations; ``train_reward``: the reward of the run's last steps to compare with
    (a number, ``trainer.state.log_history``, or a ``trainer_state.json`` or its folder: the mean logged ``reward``
    of the last 10% of the steps); ``policy-drift`` says when the held-out reward is below it by more than 0.1.
    ``processor``: a vision-language model's serving processor (default: the one saved in
    ``inference_tokenizer``'s folder, if any), compared with the one saved beside the model
    (`image-settings-drift`). Nothing of the model, its generation config or the tokenizer is changed.
    """
    from hf_sanity.measure.generate import generate, held_out_prompts, renderable, with_base

    selection = resolve(select, ignore, use_config=use_config)
    check_options(
        n=n, max_new_tokens=max_new_tokens, batch_size=batch_size, alpaca_template=alpaca_template,
        objective=objective,
    )  # fmt: skip
    if model is None or tokenizer is None or dataset is None:
        raise UserInputError("outputs needs a model, a tokenizer and a dataset of held-out prompts")
    if adapter is not None:
        check_adapter_folder(adapter)
    started = time.perf_counter()
    served = inference_tokenizer or tokenizer
    has_template = bool(getattr(served, "chat_template", None))
    dataset = as_dataset(dataset)
    objective = objective or of_columns(dataset.column_names, features=dataset.features).kind
    selection = selection.for_objective(objective)
    prompts = held_out_prompts(
        dataset, n=n, fmt=format, has_template=has_template, alpaca_template=alpaca_template
    )
    if not prompts:
        raise UserInputError(
            f"the dataset has no prompts: none of its {len(dataset)} rows has a prompt side (a user turn before "
            "the answer, a non-empty prompt)"
        )
    if not has_template and any(p.messages is not None for p in prompts):
        raise UserInputError(
            "the tokenizer has no chat template, so the conversations cannot be rendered as they will be served; "
            "pass --inference-tokenizer with the tokenizer you serve with (or prompts as plain text)"
        )
    prompts, problems = renderable(served, prompts)
    if not prompts:
        row, problem = next(iter(problems.items()))
        raise UserInputError(f"the tokenizer cannot render any of the prompts (row {row}: {problem})")
    options = dict(
        max_new_tokens=max_new_tokens, generation_config=generation_config, batch_size=batch_size, seed=seed
    )
    same_base = base is not None and base is model
    if same_base and adapter is None and not hasattr(model, "disable_adapter"):
        raise UserInputError(
            "base is the fine-tuned model itself: pass the base model, or the model with adapter= (the outputs are "
            "then compared with and without the adapter)"
        )
    with contextlib.ExitStack() as stack:
        run = model
        if adapter is not None:
            from hf_sanity.measure.adapters import attached_adapter

            run = stack.enter_context(attached_adapter(model, adapter))
        gens = generate(run, served, prompts, **options)
        if same_base:  # the same model with its adapter switched off
            with run.disable_adapter():
                base_gens = generate(run, served, prompts, **options)
            gens = with_base(gens, base_gens)
        elif base is not None:
            gens = with_base(gens, generate(base, served, prompts, **options))
    if reward_funcs:
        import dataclasses

        from hf_sanity.measure.rl import held_out_reward, training_reward

        rewards = held_out_reward(gens.samples, dataset, list(reward_funcs))
        gens = dataclasses.replace(gens, rewards={**rewards, "train": training_reward(train_reward)})
    report = Report(title="hf-sanity outputs")
    report.extend(catalog.run_all("outputs", gens, selection))
    if processor is None and inference_tokenizer is not None:
        processor = processor_beside(inference_tokenizer)
    folder = served_folder(
        model, adapter, processor
    )  # a vision-language model: the processor saved beside it
    if folder is not None:
        report.extend(catalog.run_all("saved", folder, selection))
    report.stats.update(gens.stats(), objective=objective)
    if gens.rewards is not None:
        report.stats["rewards"] = dict(gens.rewards)
    if problems:  # rows the chat template rejected: left out, and said
        report.stats["prompts_not_rendered"] = {"count": len(problems), "rows": sorted(problems)[:10],
                                                "first_problem": next(iter(problems.values()))}  # fmt: skip
    if adapter is not None:
        report.stats["adapter"] = str(adapter)
    report.stats["seconds"] = round(time.perf_counter() - started, 2)
    return report
