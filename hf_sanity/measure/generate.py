"""What the fine-tuned model actually says: held-out prompts, rendered as they will be served, generated once.

Load once, measure once: :func:`held_out_prompts` takes the prompt side of each row (a conversation up to its
last assistant turn, a prompt/completion row's prompt, Alpaca's instruction) with its reference answer;
:func:`generate` renders each prompt with the chat template the model is served with, generates greedily in
left-padded batches on the model's device, and returns a read-only :class:`Generations`. The `outputs` rules
read it; they never generate anything themselves.

Generation stops where the served model stops (the generation config's ``eos_token_id`` and the tokenizer's
EOS) and also on the chat template's end-of-turn token, so that a generation config that forgets it
(``stop-token-mismatch``) is told apart from a model that never learned to end its turn (``never-stops``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hf_sanity.errors import UserInputError
from hf_sanity.measure.encode import content_markers, template_kwargs, text_of
from hf_sanity.measure.families import FAMILY_OF
from hf_sanity.measure.formats import USER_TEXTS, Layout, detect_format, extract_prompt
from hf_sanity.measure.markers import derive_markers
from hf_sanity.measure.tensors import model_device, pad_id

DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_BATCH_SIZE = 32
# What a row without a prompt side is: the formats that have none.
NO_PROMPT_FORMATS = ("text", "tokens")


# -- prompts -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """One held-out prompt: a conversation rendered through the chat template (``messages``), a plain-text
    prompt tokenized as it is (``text``), or tokens already rendered (``ids``, a trainer's eval rows).
    ``reference``: the answer the row holds (None: a prompt-only row). ``sources``: the prompt's own texts
    (the last user turn, the system prompt, a text prompt) that an echo is compared with."""

    row: int
    messages: tuple[dict[str, Any], ...] | None = None
    text: str | None = None
    ids: tuple[int, ...] | None = None
    reference: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    shown: str = ""  # what a report shows as the prompt: the last user turn, or the text prompt
    sources: tuple[str, ...] = ()


def prompt_format(columns: Sequence[str], override: str | None = None) -> str:
    """The dataset format, for prompts: as preflight detects it, plus a prompt-only dataset (a ``prompt``
    column without ``completion``); a format without a prompt side is bad input."""
    if override is None and "prompt" in columns and "completion" not in columns and "messages" not in columns:
        return "prompt-completion"
    fmt = detect_format(columns, override)
    if fmt in NO_PROMPT_FORMATS:
        raise UserInputError(
            f"the dataset has no prompts: its rows are `{fmt}` ({', '.join(sorted(columns))}); outputs needs the "
            "prompt side of each row (a `messages` or `conversations` column, `prompt`/`completion`, or Alpaca's "
            "`instruction`/`output`)"
        )
    return fmt


def held_out_prompts(
    dataset, *, n: int, fmt: str | None = None, has_template: bool = True, alpaca_template: str | None = None
) -> list[Prompt]:
    """Up to ``n`` prompts from ``dataset`` (rows as the trainer reads them, see ``formats.Layout``), spread
    evenly over it; rows without a prompt side are passed over."""
    fmt = prompt_format(dataset.column_names, fmt)
    layout = Layout.of(fmt, has_template=has_template, alpaca_template=alpaca_template)
    total = len(dataset)
    if total == 0 or n < 1:
        return []
    picks = _spread(total, min(n, total))
    chosen = set(picks)
    order = picks + [i for i in range(total) if i not in chosen]
    out: list[Prompt] = []
    for index in order:
        if len(out) == n:
            break
        row = layout.to_trl(dataset[int(index)])
        prompt = _prompt_of(int(index), row) if isinstance(row, dict) else None
        if prompt is not None:
            out.append(prompt)
    return sorted(out, key=lambda p: p.row)


def _spread(total: int, k: int) -> list[int]:
    if k >= total:
        return list(range(total))
    return sorted({round(i * (total - 1) / max(k - 1, 1)) for i in range(k)})


def _prompt_of(index: int, row: dict[str, Any]) -> Prompt | None:
    if (
        "chosen" in row and "rejected" in row
    ):  # a preference pair: its prompt, the chosen answer the reference
        prompt, chosen = row.get("prompt"), row["chosen"]
        if prompt is None:
            prompt, chosen, _ = extract_prompt(row["chosen"], row["rejected"])
        row = {**row, "prompt": prompt, "completion": chosen}
    elif row.get("label") is False:  # KTO's undesirable answer is no reference
        row = {**row, "completion": None}
    kwargs = template_kwargs(row)
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    if isinstance(row.get("messages"), list):
        messages = [m for m in row["messages"] if isinstance(m, dict)]
        last = max((j for j, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
        if last >= 0 and last == len(messages) - 1:
            return _chat_prompt(index, messages[:last], [messages[last]], kwargs)
        return _chat_prompt(index, messages, [], kwargs)
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, list):
        completion = completion if isinstance(completion, list) else []
        return _chat_prompt(index, [m for m in prompt if isinstance(m, dict)], completion, kwargs)
    if isinstance(prompt, str) and prompt.strip():
        own = row.get(USER_TEXTS)  # Alpaca's own texts, inside the `### Instruction:` scaffolding
        sources = tuple(t for t in ([own[0]] if own else []) + [prompt] if isinstance(t, str) and t.strip())
        reference = completion if isinstance(completion, str) and completion.strip() else None
        shown = own[0] if own and isinstance(own[0], str) else prompt
        return Prompt(index, text=prompt, reference=reference, shown=shown, sources=sources)
    return None


def _chat_prompt(index, messages, answer, kwargs) -> Prompt | None:
    said = [m for m in messages if m.get("role") in ("user", "tool", "ipython", "function")]
    if not said or not all(isinstance(m.get("content", ""), (str, type(None))) for m in messages):
        return None
    user = text_of(said[-1])
    system = next((text_of(m) for m in messages if m.get("role") in ("system", "developer")), "")
    reference = " ".join(text_of(m) for m in answer if m.get("role") == "assistant").strip() or None
    earlier = len(messages) - 1
    shown = user if earlier == 0 else f"[{earlier} earlier message{'s' if earlier > 1 else ''}] {user}"
    return Prompt(
        index,
        messages=tuple(messages),
        reference=reference,
        kwargs=kwargs,
        shown=shown,
        sources=tuple(s for s in (user, system) if s.strip()),
    )


def prompts_from_tokens(rows, tokenizer, *, n: int) -> list[Prompt]:
    """Prompts from tokenized rows (a Trainer's eval dataset): the tokens before the last supervised answer
    (``labels``, TRL's ``completion_mask``/``assistant_masks``, else the chat template's markers), and that
    answer as the reference."""
    markers = derive_markers(tokenizer)
    out: list[Prompt] = []
    total = len(rows)
    for index in _spread(total, min(n, total)) if total else []:
        row = rows[int(index)]
        ids = [int(i) for i in row.get("input_ids") or []]
        if not ids:
            continue
        mask = row.get("attention_mask")
        keep = [k for k in range(len(ids)) if mask is None or int(mask[k])]
        ids = [ids[k] for k in keep]
        start, stop = _last_answer(row, keep, ids, markers)
        if start is None or start == 0:
            continue
        answer = [i for i in ids[start:stop] if i not in markers.stop_ids]
        reference = tokenizer.decode(answer, skip_special_tokens=True).strip() or None
        shown = tokenizer.decode(ids[:start], skip_special_tokens=False)
        out.append(Prompt(int(index), ids=tuple(ids[:start]), reference=reference, shown=_tail(shown)))
    return out


def _last_answer(row, keep, ids, markers) -> tuple[int | None, int]:
    for key in ("labels", "completion_mask", "assistant_masks"):
        values = row.get(key)
        if values is None or len(values) < len(keep):
            continue
        flags = [(int(values[k]) != -100) if key == "labels" else bool(int(values[k])) for k in keep]
        if not any(flags):
            continue
        stop = max(k for k, f in enumerate(flags) if f) + 1
        start = stop
        while start > 0 and flags[start - 1]:
            start -= 1
        return start, stop
    spans = markers.locate(ids) if markers.locatable else []
    return (spans[-1].start, spans[-1].stop) if spans else (None, 0)


def _tail(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else "…" + text[-limit:]


# -- what was generated ----------------------------------------------------------------------------------
STOPPED = "stop"  # on a token the served model stops on
END_OF_TURN = (
    "end-of-turn"  # on the template's end of turn, which the served generation config does not stop on
)
LENGTH = "length"  # max_new_tokens reached without either


@dataclass(frozen=True)
class Sample:
    """One prompt and what the model generated for it (greedy)."""

    row: int
    prompt: str  # as a report shows it
    sources: tuple[str, ...]  # the prompt's own texts, for the echo check
    prompt_tokens: int
    ids: tuple[int, ...]  # the generated tokens, the stop token included
    text: str  # the generation without special tokens, stop token excluded
    raw: str  # the generation with special tokens as text (markers visible), stop token excluded
    stop: str  # STOPPED, END_OF_TURN or LENGTH
    reference: str | None = None
    reference_tokens: int | None = None
    base_ids: tuple[int, ...] | None = None  # the base model's generation for the same prompt
    base_text: str | None = None
    # The longest back-to-back repetition in the generation: the same ``loop_period`` tokens repeated over
    # ``loop_tokens`` tokens (0, 0: none), ending ``loop_end`` tokens into it; the repeated unit as text.
    loop_period: int = 0
    loop_tokens: int = 0
    loop_end: int = 0
    loop_unit: str = ""

    @property
    def stopped(self) -> bool:
        return self.stop != LENGTH

    @property
    def body(self) -> tuple[int, ...]:
        """The generated tokens without the stop token."""
        return self.ids[:-1] if self.stopped else self.ids


@dataclass(frozen=True)
class Generations:
    """Every sample, and how generation was set up: read by the `outputs` rules, never written."""

    samples: tuple[Sample, ...]
    max_new_tokens: int
    stop_ids: frozenset[int]  # generation stopped on these: the served stops plus the template's end of turn
    served_stop_ids: frozenset[int] | None  # the served generation config's eos_token_id (None: unknown)
    end_of_turn_ids: tuple[int, ...] = ()  # the chat template's end of turn (empty: no template)
    end_of_turn: str = ""
    token_names: Mapping[int, str] = field(default_factory=dict)  # stop and end-of-turn ids, as tokens
    markers: tuple[str, ...] = ()  # template and role markers that never belong inside an answer
    own_markers: tuple[str, ...] = ()  # ... of them, those the served template itself renders
    template: bool = True  # prompts were rendered by a chat template
    has_base: bool = False
    seconds: float = 0.0
    base_seconds: float = 0.0
    device: str = "cpu"
    # With reward functions (RL): their mean reward on these generations against the training reward
    # (`measure.rl.held_out_reward`: "held_out", "train", "functions", "errors").
    rewards: Mapping[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def expected_stop(self) -> str:
        """The token the model should end its answer with: the template's end of turn, else EOS."""
        if self.end_of_turn:
            return self.end_of_turn
        served = sorted(self.served_stop_ids or self.stop_ids)
        return self.token_names.get(served[0], "") if served else ""

    def stats(self) -> dict[str, Any]:
        tokens = sum(len(s.ids) for s in self.samples)
        return {
            "prompts": len(self.samples),
            "max_new_tokens": self.max_new_tokens,
            "generated_tokens": tokens,
            "stopped": sum(s.stopped for s in self.samples),
            "generation_seconds": round(self.seconds, 2),
            **({"base_generation_seconds": round(self.base_seconds, 2)} if self.has_base else {}),
            "device": self.device,
        }


def served_stop_ids(generation_config) -> frozenset[int] | None:
    """The token ids that end generation when served: the generation config's ``eos_token_id``, what
    ``model.generate`` stops on (the tokenizer's EOS is not among them unless the config names it: a Llama-3
    tokenizer whose EOS is ``<|eot_id|>`` with a config that names ``<|end_of_text|>`` only runs past every
    ``<|eot_id|>``); empty when the config names none; None when no generation config is known."""
    if generation_config is None:
        return None
    eos = getattr(generation_config, "eos_token_id", None)
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    return frozenset(int(i) for i in ids if i is not None)


def output_markers(tokenizer) -> tuple[str, ...]:
    """Strings that never belong inside an answer: the tokenizer's special and added tokens that are not
    content (a reasoning ``<think>`` is), and every known chat format's turn markers."""
    specials = {str(t) for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()}
    specials |= {str(t) for t in tokenizer.all_special_tokens}
    specials -= content_markers(tokenizer, derive_markers(tokenizer))
    return tuple(sorted((specials | set(FAMILY_OF)) - {""}, key=lambda s: (-len(s), s)))


def own_markers(tokenizer, markers) -> tuple[str, ...]:
    """The turn markers the served template renders itself (a model that writes them ran into a new turn)."""
    from hf_sanity.measure.families import FORMAT_MARKERS, own_families

    own = {tokenizer.decode([i]) for i in markers.turn_marker_ids}
    own |= {m for family in own_families(tokenizer) for m in FORMAT_MARKERS[family]}
    return tuple(sorted(own))


def repeated_run(ids: Sequence[int], max_period: int = 64) -> tuple[int, int, int]:
    """The longest run of one n-gram repeated back to back (period ``p`` up to ``max_period`` tokens, at least
    4 repeats and 8 tokens), as (p, run length, where it ends); (0, 0, 0) when there is none."""
    n = len(ids)
    best = (0, 0, 0)
    for p in range(1, min(max_period, n // 4) + 1):
        matched = 0  # positions i so far with ids[i] == ids[i - p], back to back
        for i in range(p, n + 1):
            if i < n and ids[i] == ids[i - p]:
                matched += 1
                continue
            length = matched + p  # the matched positions plus the first unit they repeat
            if matched and length >= max(4 * p, 8) and length > best[1]:
                best = (p, length, i)
            matched = 0
    return best


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """The prompt's token ids as the served model receives them."""
    if prompt.ids is not None:
        return list(prompt.ids)
    if prompt.messages is not None:
        text = tokenizer.apply_chat_template(
            list(prompt.messages), tokenize=False, add_generation_prompt=True, **dict(prompt.kwargs)
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt.text)["input_ids"]


def renderable(tokenizer, prompts: Sequence[Prompt]) -> tuple[list[Prompt], dict[int, str]]:
    """The prompts the tokenizer renders, and why each other one fails (row -> one line): a chat template that
    rejects a row (a role it does not know, a system turn it refuses) is that row's problem, not the run's."""
    ok, problems = [], {}
    for prompt in prompts:
        try:
            if encode_prompt(tokenizer, prompt):
                ok.append(prompt)
            else:
                problems[prompt.row] = "the prompt renders to no tokens"
        except Exception as exc:
            problems[prompt.row] = (
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            )
    return ok, problems


def generate(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    generation_config=None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
) -> Generations:
    """Greedy generations of ``model`` for ``prompts`` (:func:`with_base` adds a base model's).

    ``generation_config``: how the model is served (default: the model's own); a copy is used, made greedy,
    and nothing of the model or its config is changed. Batches are left-padded and placed on the model's
    device; the model runs in eval mode under ``no_grad`` and comes back in the mode it was in, with its
    gradients and the RNG states untouched (:func:`hf_sanity.untouched.untouched`).
    """
    if not hasattr(model, "generate"):
        raise UserInputError(f"the model ({type(model).__name__}) has no generate(); pass a causal LM")
    own = getattr(model, "generation_config", None)
    served = generation_config if generation_config is not None else own
    markers = derive_markers(tokenizer)
    eot = tuple(markers.end_of_turn)
    serve_stops = served_stop_ids(served)
    # generate() fills in what a given config leaves unset from the model's own.
    if not serve_stops and served is not own:
        serve_stops = served_stop_ids(own) if own is not None else serve_stops
    stops = set(serve_stops or {tokenizer.eos_token_id} - {None})
    if eot:
        stops.add(eot[-1])
    if not stops:
        raise UserInputError("the tokenizer has no EOS token and the generation config no eos_token_id: nothing "
                             "can end a generation")  # fmt: skip
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    references = [
        len(tokenizer(p.reference, add_special_tokens=False)["input_ids"]) if p.reference else None
        for p in prompts
    ]
    started = time.perf_counter()
    outs = _generate_ids(model, tokenizer, encoded, served, stops, max_new_tokens, batch_size, seed)
    seconds = time.perf_counter() - started
    samples = []
    for k, (prompt, ids) in enumerate(zip(prompts, outs)):
        stop = LENGTH
        if ids and ids[-1] in stops:
            stop = STOPPED if serve_stops is None or ids[-1] in serve_stops else END_OF_TURN
        body = ids[:-1] if stop != LENGTH else ids
        period, looped, end = repeated_run(body)
        samples.append(
            Sample(
                row=prompt.row,
                prompt=prompt.shown or (prompt.text or ""),
                sources=prompt.sources,
                prompt_tokens=len(encoded[k]),
                ids=tuple(ids),
                text=tokenizer.decode(body, skip_special_tokens=True),
                raw=tokenizer.decode(body, skip_special_tokens=False),
                stop=stop,
                reference=prompt.reference,
                reference_tokens=references[k],
                loop_period=period,
                loop_tokens=looped,
                loop_end=end,
                loop_unit=tokenizer.decode(body[end - period : end]) if period else "",
            )
        )
    names = sorted(stops | set(eot))
    return Generations(
        samples=tuple(samples),
        max_new_tokens=max_new_tokens,
        stop_ids=frozenset(stops),
        served_stop_ids=serve_stops,
        end_of_turn_ids=eot,
        end_of_turn=tokenizer.decode(list(eot)) if eot else "",
        token_names=dict(zip(names, tokenizer.convert_ids_to_tokens(names))),
        markers=output_markers(tokenizer),
        own_markers=own_markers(tokenizer, markers),
        template=any(p.messages is not None for p in prompts),
        seconds=seconds,
        device=str(model_device(model)),
    )


def with_base(gens: Generations, base: Generations) -> Generations:
    """``gens`` with the base model's generations for the same prompts (from :func:`generate` on the same
    prompts, tokenizer and stops), for ``adapter-no-effect``."""
    import dataclasses

    if [s.row for s in gens.samples] != [s.row for s in base.samples]:
        raise ValueError("the base generations are for other prompts")
    samples = tuple(
        dataclasses.replace(s, base_ids=b.ids, base_text=b.raw) for s, b in zip(gens.samples, base.samples)
    )
    return dataclasses.replace(gens, samples=samples, has_base=True, base_seconds=base.seconds)


def greedy_config(served, *, stops, pad: int, max_new_tokens: int):
    """A greedy copy of the served generation config that stops on ``stops``."""
    from transformers import GenerationConfig

    config = copy.deepcopy(served) if served is not None else GenerationConfig()
    for name in ("temperature", "top_p", "top_k", "typical_p", "min_p", "epsilon_cutoff", "eta_cutoff"):
        if hasattr(config, name):
            setattr(config, name, None)
    config.do_sample = False
    config.num_beams = 1
    config.num_return_sequences = 1
    config.max_new_tokens = max_new_tokens
    config.max_length = None
    config.min_new_tokens = None
    config.min_length = 0
    config.eos_token_id = sorted(stops)
    config.pad_token_id = pad
    return config


def _generate_ids(
    model, tokenizer, encoded, served, stops, max_new_tokens, batch_size, seed
) -> list[list[int]]:
    """The generated ids of each prompt, cut after the first stop token (inclusive)."""
    import torch

    from hf_sanity.untouched import untouched

    pad = pad_id(tokenizer)
    config = greedy_config(served, stops=stops, pad=pad, max_new_tokens=max_new_tokens)
    device = model_device(model)
    order = sorted(range(len(encoded)), key=lambda k: len(encoded[k]))  # similar lengths pad less
    out: list[list[int]] = [[] for _ in encoded]
    with untouched(model):
        torch.manual_seed(seed)
        for lo in range(0, len(order), batch_size):
            chunk = order[lo : lo + batch_size]
            width = max(len(encoded[k]) for k in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long, device=device)
            mask = torch.zeros((len(chunk), width), dtype=torch.long, device=device)
            for j, k in enumerate(chunk):  # left padding: every prompt ends where generation starts
                ids = encoded[k]
                input_ids[j, width - len(ids) :] = torch.tensor(ids, dtype=torch.long, device=device)
                mask[j, width - len(ids) :] = 1
            generated = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
            for j, k in enumerate(chunk):
                new = generated[j, width:].tolist()
                cut = next((i for i, t in enumerate(new) if t in stops), None)
                out[k] = new[: cut + 1] if cut is not None else new[:max_new_tokens]
    return out
