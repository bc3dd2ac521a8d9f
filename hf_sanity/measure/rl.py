"""Online RL from reward functions (TRL 1.16's ``GRPOTrainer`` and ``RLOOTrainer``): the completions the trainer
will make and how its reward functions score them, measured before training; and its rollouts as it makes
them, read from the trainer during training.

What TRL 1.16 does (``grpo_trainer.py``; ``rloo_trainer.py`` alike), and what is measured here the same way:

* prompts: conversational ones rendered with the chat template and the generation prompt, text ones tokenized
  with special tokens; never truncated;
* generation: ``trainer.generation_config`` (temperature, top_p, top_k, min_p, ``max_new_tokens`` =
  ``max_completion_length``), stopping on ``trainer.eos_token_ids`` (the generation config's EOS and the
  tokenizer's); a completion is *clipped* when its last id is none of those nor the pad id;
* reward functions: ``f(prompts=, completions=, completion_ids=, **columns, trainer_state=, log_extra=,
  log_metric=)``, the completions decoded with ``skip_special_tokens=True`` (special tokens stripped), as strings
  for text prompts and as ``[{"role": "assistant", "content": text}]`` for conversational ones, every column of
  the row repeated per completion (only ``prompt``/``image``/``images`` under ``remove_unused_columns=True``);
  ``None`` becomes NaN;
* groups: ``num_generations`` consecutive completions share a prompt; under ``scale_rewards="group"`` each
  advantage is (r - mean of its group) / (std of its group + 1e-4); a group whose std is 0 carries no gradient.

The dry run changes nothing: every call of every reward function runs in one forked child process on copies of
its inputs, each stopped at its time limit (:mod:`hf_sanity.measure.user_code`: what it draws from the random
generators, writes or starts stays in the child; where no fork exists nothing is called and the report says why);
the callback starts it at train begin and reads its verdicts at the first step's end (:func:`start_dry_run`); under
torch.distributed only the main process calls them (a paid judge is billed once) and every rank gets its verdict;
the model generates under :func:`hf_sanity.untouched.untouched` (modes, grads and RNG restored).

A function that gives every completion tried one value is broken only when that value is constant by
construction: it is called once more with completions that fail on any use (and their ids alike), and one that
returns the same without touching them does not read its completions. One that reads them and gave one value is
sparse (zero on these samples): its pass rate is the group rules' to judge, not reward-function-broken's.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import inspect
import math
import numbers
import re
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from hf_sanity.measure.formats import is_conversational
from hf_sanity.measure.processing import trainer_tokenizer

SAMPLE_PROMPTS = 4  # prompts the preflight estimate generates a group for
SYNTHETIC_PROMPTS = 4  # rows the dry run builds completions for (4 completions each)
REWARD_TIMEOUT = 20.0  # seconds a reward function may take on one dry-run batch (read at each call)
NONE_SHARE = 0.10  # more None rewards than this is an error
# What TRL passes every reward function beside the dataset's columns.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                 "environments", "kwargs")  # fmt: skip
# Columns that hold the reference answer, most specific first (else the first other text column).
REFERENCE_COLUMNS = ("answer", "solution", "ground_truth", "reference", "target", "gold", "expected",
                     "response", "output", "completion", "label")  # fmt: skip
SIGNATURE_COLUMNS = ("prompt", "image", "images")  # what TRL keeps under remove_unused_columns=True
REASONING = "<think>\nLet me think step by step.\n</think>\n<answer>\n{}\n</answer>"


# -- the trainer's settings ----------------------------------------------------------------------------------
def stop_ids(trainer) -> list[int]:
    """The ids the trainer's generation stops on: the ``eos_token_id`` of the generation config it passes
    ``generate`` (TRL 1.16: ``trainer.eos_token_ids``, the model's generation config's EOS and the tokenizer's,
    unless ``generation_kwargs`` overrides it), else ``trainer.eos_token_ids`` (vLLM, which stops on both), else
    what TRL builds it from."""
    configured = getattr(getattr(trainer, "generation_config", None), "eos_token_id", None)
    if configured is None:
        configured = getattr(
            trainer, "eos_token_ids", None
        )  # (a tokenizer without an EOS id leaves None in it)
    if configured is not None:
        listed = [configured] if isinstance(configured, int) else list(configured)
        return [int(i) for i in listed if i is not None]
    configured = getattr(getattr(trainer.model, "generation_config", None), "eos_token_id", None)
    out = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    eos = getattr(trainer_tokenizer(trainer), "eos_token_id", None)
    return [int(i) for i in ([eos] if eos is not None and eos not in out else []) + out]


def generation_config(trainer):
    """A copy of the trainer's sampling settings (``trainer.generation_config``; rebuilt from its attributes when it
    has none: vLLM)."""
    from transformers import GenerationConfig

    from hf_sanity.measure.tensors import pad_id

    given = getattr(trainer, "generation_config", None)
    if given is not None:
        return copy.deepcopy(given)
    args = trainer.args
    return GenerationConfig(
        max_new_tokens=getattr(args, "max_completion_length", 256),
        do_sample=True,
        temperature=getattr(args, "temperature", 1.0),
        top_p=getattr(args, "top_p", 1.0),
        top_k=getattr(args, "top_k", 0) or None,
        min_p=getattr(args, "min_p", None),
        repetition_penalty=getattr(args, "repetition_penalty", 1.0),
        eos_token_id=stop_ids(trainer),
        pad_token_id=pad_id(trainer_tokenizer(trainer)),
    )


def stop_mismatch(trainer) -> dict[str, Any]:
    """The template's end of turn when the trainer does not stop on it (empty when it does, or has no template)."""
    from hf_sanity.measure.markers import derive_markers

    tokenizer = trainer_tokenizer(trainer)
    eot = derive_markers(tokenizer).end_of_turn if tokenizer is not None else ()
    stops = stop_ids(trainer)
    if not eot or eot[-1] in stops:
        return {}
    return {
        "end_of_turn": tokenizer.decode(list(eot)),
        "end_of_turn_id": int(eot[-1]),
        "stop_ids": stops,
        "stop_tokens": tokenizer.convert_ids_to_tokens(stops),
    }


def prompt_ids(tokenizer, prompt, template_kwargs: dict | None = None) -> list[int]:
    """A prompt's ids as TRL renders it for generation."""
    if is_conversational(prompt):
        out = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True, **(template_kwargs or {})
        )
        return list(out["input_ids"])
    return list(tokenizer(text=prompt)["input_ids"])


def dataset_rows(trainer, n: int) -> list[dict[str, Any]]:
    """The first ``n`` rows of the trainer's dataset with a prompt, with the columns TRL hands the reward functions."""
    data = getattr(trainer, "train_dataset", None)
    if (
        data is None
        or not hasattr(data, "select")
        or "prompt" not in (getattr(data, "column_names", None) or ())
    ):
        return []  # an IterableDataset (no random access): nothing is drawn from it
    rows = data.select(range(min(n, len(data)))).to_list()
    if getattr(trainer.args, "remove_unused_columns", False):
        rows = [{k: v for k, v in row.items() if k in SIGNATURE_COLUMNS} for row in rows]
    return rows


def reward_funcs(trainer) -> list[tuple[str, Any]]:
    """(name, function) of each reward function, named as TRL logs it (``rewards/<name>/mean``)."""
    funcs = list(getattr(trainer, "reward_funcs", None) or ())
    names = list(getattr(trainer, "reward_func_names", None) or ())
    if len(names) != len(funcs):
        names = [getattr(f, "__name__", type(f).__name__) for f in funcs]
    return list(zip(names, funcs))


# -- completions, in the shape TRL passes them ------------------------------------------------------------------
@dataclass(frozen=True)
class Completions:
    """Completions in group order (``group_size`` consecutive ones share a row), with what TRL passes beside them."""

    rows: list[dict[str, Any]]  # the dataset row of each completion
    texts: list[str]  # decoded as TRL decodes them (special tokens stripped)
    ids: list[list[int]]
    conversational: bool
    group_size: int
    source: str  # "synthetic" (built from the dataset's answers) or "sampled" (generated by the model)

    def __len__(self) -> int:
        return len(self.texts)

    def completions(self, *, as_text: bool = False) -> list[Any]:
        if self.conversational and not as_text:
            return [[{"role": "assistant", "content": text}] for text in self.texts]
        return list(self.texts)

    def kwargs(self, trainer_state, *, as_text: bool = False) -> dict[str, Any]:
        """The keyword arguments TRL calls a reward function with."""
        columns = [
            k
            for k in (self.rows[0] if self.rows else {})
            if k not in ("prompt", "completion", "completion_ids")
        ]
        return {
            "prompts": [row.get("prompt") for row in self.rows],
            "completions": self.completions(as_text=as_text),
            "completion_ids": [list(ids) for ids in self.ids],
            **{key: [row.get(key) for row in self.rows] for key in columns},
            "trainer_state": trainer_state,
            "log_extra": lambda *args, **kw: None,
            "log_metric": lambda *args, **kw: None,
        }


def reference_of(row: dict[str, Any]) -> str | None:
    """The row's reference answer: a known answer column, else the first other text column."""
    texts = {k: v for k, v in row.items() if k != "prompt" and isinstance(v, str) and v.strip()}
    for key in REFERENCE_COLUMNS:
        if key in texts:
            return texts[key]
    messages = [v for k, v in row.items() if k != "prompt" and is_conversational(v)]
    if messages and isinstance(messages[0][-1].get("content"), str):
        return messages[0][-1]["content"]
    return next(iter(texts.values()), None)


def _changed(text: str) -> str:
    """Another answer of the same shape: every digit shifted by one, else the words reversed."""
    if any(ch.isdigit() for ch in text):
        return re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), text)
    words = text.split()
    return " ".join(reversed(words)) if len(words) > 1 else f"not {text}"


def variants(reference: str | None) -> list[str]:
    """Four completions that differ in content: the reference answer, the same in a reasoning format over several
    lines, a wrong answer of the same shape, an empty one."""
    answer = reference if reference is not None else "The answer is 42."
    return [
        answer,
        REASONING.format(answer),
        _changed(answer) if reference is not None else "I do not know.",
        "",
    ]


def synthetic(trainer, rows: Sequence[dict[str, Any]] | None = None) -> Completions | None:
    """The dry run's completions: for each of the first rows, :func:`variants` of its reference answer."""
    tokenizer = trainer_tokenizer(trainer)
    rows = list(rows if rows is not None else dataset_rows(trainer, SYNTHETIC_PROMPTS))
    if not rows or tokenizer is None:
        return None
    per_row = [variants(reference_of(row)) for row in rows]
    texts = [text for group in per_row for text in group]
    return Completions(
        rows=[row for row, group in zip(rows, per_row) for _ in group],
        texts=texts,
        ids=[tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts],
        conversational=is_conversational(rows[0].get("prompt")),
        group_size=len(per_row[0]),
        source="synthetic",
    )


@dataclass(frozen=True)
class Sampled:
    """G completions for each of a few prompts, generated as the trainer generates them."""

    completions: Completions
    clipped: list[bool]
    lengths: list[int]
    max_new_tokens: int
    stop_ids: list[int]
    end_of_turn_id: int | None  # the token that closes an assistant turn in the chat template
    # Clipped completions that wrote the end of turn (the trainer does not stop on it).
    end_of_turn_inside: int
    looping: int  # clipped completions that repeat one unit to their end
    seconds: float

    @property
    def clipped_share(self) -> float:
        return sum(self.clipped) / len(self.clipped) if self.clipped else 0.0

    @property
    def terminated_lengths(self) -> list[int]:
        return [n for n, c in zip(self.lengths, self.clipped) if not c]


def sample(trainer, *, prompts: int = SAMPLE_PROMPTS, group_size: int | None = None, seed: int = 0,
           config=None) -> Sampled | None:  # fmt: skip
    """``group_size`` (the trainer's ``num_generations``) completions for each of the first ``prompts`` rows, from the
    model as it is, with the trainer's generation settings (``config``: others). None without prompts."""
    from hf_sanity.measure.generate import repeated_run
    from hf_sanity.measure.markers import derive_markers
    from hf_sanity.measure.tensors import pad_id

    tokenizer = trainer_tokenizer(trainer)
    rows = dataset_rows(trainer, prompts)
    model = trainer.model
    if not rows or tokenizer is None or not hasattr(model, "generate"):
        return None
    group = group_size or int(getattr(trainer, "num_generations", None) or trainer.args.num_generations)
    config = config or generation_config(trainer)
    stops = stop_ids(trainer)
    pad = pad_id(tokenizer)
    template_kwargs = getattr(trainer, "chat_template_kwargs", None) or {}
    encoded = [prompt_ids(tokenizer, row["prompt"], template_kwargs) for row in rows for _ in range(group)]
    started = time.perf_counter()
    completion_ids = _generate(model, encoded, config, pad, stops, seed)
    seconds = time.perf_counter() - started
    ends = set(stops) | {pad}
    clipped = [not ids or ids[-1] not in ends for ids in completion_ids]
    eot = derive_markers(tokenizer).end_of_turn
    eot_id = eot[-1] if eot else None
    inside = sum(c and eot_id is not None and eot_id in ids for ids, c in zip(completion_ids, clipped))
    looping = 0
    for ids, c in zip(completion_ids, clipped):
        _, tokens, _ = repeated_run(ids) if c else (0, 0, 0)
        looping += bool(c and tokens >= 0.5 * max(len(ids), 1))
    return Sampled(
        completions=Completions(
            rows=[row for row in rows for _ in range(group)],
            texts=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
            ids=completion_ids,
            conversational=is_conversational(rows[0]["prompt"]),
            group_size=group,
            source="sampled",
        ),
        clipped=clipped,
        lengths=[len(ids) for ids in completion_ids],
        max_new_tokens=int(config.max_new_tokens),
        stop_ids=stops,
        end_of_turn_id=eot_id,
        end_of_turn_inside=inside,
        looping=looping,
        seconds=seconds,
    )


def _generate(
    model, encoded: Sequence[list[int]], config, pad: int, stops: Sequence[int], seed: int
) -> list[list[int]]:
    """What ``model`` generates after each of ``encoded`` (left-padded, as TRL pads prompts) with ``config``, cut
    after the first of ``stops`` (inclusive), the model and the RNG untouched."""
    import torch

    from hf_sanity.measure.tensors import model_device
    from hf_sanity.untouched import untouched

    width = max(len(ids) for ids in encoded)
    device = model_device(model)
    input_ids = torch.full((len(encoded), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(encoded):
        input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long, device=device)
        mask[i, width - len(ids) :] = 1
    with untouched(model):
        torch.manual_seed(seed)
        generated = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
    out = []
    for row in generated[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), None)
        out.append(row[: cut + 1] if cut is not None else row[: config.max_new_tokens])
    return out


CONTINUED = 8  # clipped completions continued past the cap
CONTINUE_FACTOR = 4  # ... to this many times the cap
CONTINUE_MAX_TOKENS = 2048  # ... at most this many tokens past it


@dataclass(frozen=True)
class Continued:
    """Clipped completions generated on past the cap: do they end later (the cap is short), or never (the policy
    does not end its turns)?"""

    completions: int  # the clipped completions continued
    ended: int  # those that reached a stop id by ``max_tokens``
    lengths: list[int]  # the whole length of each of those that ended
    max_tokens: int  # the length they were continued to (the cap included)
    seconds: float


def continue_clipped(trainer, sampled: Sampled, *, count: int = CONTINUED, factor: int = CONTINUE_FACTOR,
                     seed: int = 0) -> Continued | None:  # fmt: skip
    """Up to ``count`` of ``sampled``'s clipped completions generated on, with the trainer's settings, until
    ``factor`` times the cap: which of them end, and how long they are then."""
    from hf_sanity.measure.tensors import pad_id

    tokenizer = trainer_tokenizer(trainer)
    picked = [i for i, c in enumerate(sampled.clipped) if c][:count]
    if not picked or tokenizer is None:
        return None
    cap = sampled.max_new_tokens
    extra = min((factor - 1) * cap, CONTINUE_MAX_TOKENS)
    config = generation_config(trainer)
    config.max_new_tokens = extra
    template_kwargs = getattr(trainer, "chat_template_kwargs", None) or {}
    rows, ids = sampled.completions.rows, sampled.completions.ids
    encoded = [prompt_ids(tokenizer, rows[i]["prompt"], template_kwargs) + list(ids[i]) for i in picked]
    started = time.perf_counter()
    more = _generate(trainer.model, encoded, config, pad_id(tokenizer), sampled.stop_ids, seed)
    seconds = time.perf_counter() - started
    stops = set(sampled.stop_ids)
    ended = [len(ids[i]) + len(m) for i, m in zip(picked, more) if m and m[-1] in stops]
    return Continued(len(picked), len(ended), ended, cap + extra, seconds)


# -- calling a reward function safely ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One call of a reward function on one batch of completions."""

    # Floats, None or NotANumber; None when it raised, ran out of time or was skipped.
    values: list[Any] | None
    error: str | None = None  # "TypeError: ..."
    timed_out: bool = False
    seconds: float = 0.0
    skipped: str | None = None  # why it was not called or not judged (see `user_code.Outcome.skipped`)

    def finite(self) -> list[float]:
        return [float(v) for v in self.values or () if _number(v) and math.isfinite(float(v))]


@dataclass(frozen=True)
class NotANumber:
    """What a reward function returned where a number belongs, as its type's name (it crosses processes)."""

    type_name: str


def _number(value) -> bool:
    return isinstance(value, numbers.Real) or (
        hasattr(value, "__float__") and not isinstance(value, NotANumber)
    )  # numpy and torch scalars too


def call_reward(func: Callable, kwargs: dict[str, Any], timeout: float | None = None) -> Call:
    """``func(**kwargs)`` on a copy of ``kwargs`` in a child process, at most ``timeout`` seconds (default
    :data:`REWARD_TIMEOUT`), abandoned there at the deadline (:func:`hf_sanity.measure.user_code.run_isolated`)."""
    from hf_sanity.measure.user_code import run_isolated

    outcome = run_isolated(lambda: _rewards(func, kwargs), REWARD_TIMEOUT if timeout is None else timeout)
    return Call(outcome.value, outcome.error, outcome.timed_out, outcome.seconds, outcome.skipped)


def _rewards(func: Callable, kwargs: dict[str, Any]) -> list[Any]:
    """In the child: what ``func`` returns for a copy of ``kwargs``, each reward as a float, None or
    :class:`NotANumber`."""
    out = func(**copy.deepcopy(kwargs))
    if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
    return [None if v is None else _as_float(v) for v in out]


async def _awaited(awaitable):
    return await awaitable


def _as_float(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return NotANumber(type(value).__name__)  # not a number: the finding names it


class Unread:
    """Stands in for a completion (or its ids) in :func:`reads_completions`: any use of it is recorded, and fails."""

    used = False  # in the child process that runs the probe

    def _use(self, *args, **kwargs):
        Unread.used = True
        raise TypeError("hf-sanity's probe: a completion was read")

    def __getattr__(self, name):
        Unread.used = True
        raise AttributeError(name)

    def __deepcopy__(self, memo):
        return self

    __str__ = __repr__ = __format__ = __bytes__ = __len__ = __iter__ = __getitem__ = __contains__ = _use
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = __bool__ = _use
    __add__ = __radd__ = __mul__ = __rmul__ = __mod__ = __int__ = __float__ = __index__ = __fspath__ = _use


def reads_completions(func: Callable, kwargs: dict[str, Any], timeout: float | None = None) -> bool | None:
    """Whether ``func`` reads the completions it scores: called on ``kwargs`` and again with every completion
    and its ids replaced by :class:`Unread` objects, it reads them when the second call fails, returns other
    rewards, uses one of them, or raises (and catches) an exception where the first did not (a regex or a parser
    handed a non-string, inside a ``try``). None when that could not be told (the calls failed or timed out)."""
    from hf_sanity.measure.user_code import run_isolated

    outcome = run_isolated(lambda: _probe(func, kwargs), REWARD_TIMEOUT if timeout is None else timeout)
    return outcome.value if outcome.error is None and not outcome.timed_out and not outcome.skipped else None


def _probe(func: Callable, kwargs: dict[str, Any]) -> bool | None:
    """In the child: :func:`reads_completions`."""
    n = len(kwargs["completions"])
    unread = {
        **kwargs,
        "completions": [Unread() for _ in range(n)],
        "completion_ids": [Unread() for _ in range(n)],
    }
    baseline, seen = _traced(func, kwargs)
    if baseline[0] != "ok":
        return None  # it fails on the real completions: nothing to compare with
    Unread.used = False
    probed, seen_probed = _traced(func, unread)
    same = probed[0] == "ok" and _same(probed[1], baseline[1])
    return not same or Unread.used or bool(seen_probed - seen)


def _traced(func: Callable, kwargs: dict[str, Any]) -> tuple[tuple[str, Any], set]:
    """(("ok", rewards) or ("raised", None), the places where an exception was raised during the call)."""
    places: set = set()

    def local(frame, event, arg):
        if event == "exception":
            places.add((frame.f_code.co_filename, frame.f_lineno, arg[0].__name__))
        return local

    def calls(frame, event, arg):
        frame.f_trace_lines = False  # exceptions only: the call runs at its own speed otherwise
        return local

    sys.settrace(calls)
    try:
        result: tuple[str, Any] = ("ok", _rewards(func, kwargs))
    except Exception:
        result = ("raised", None)
    finally:
        sys.settrace(None)
    return result, places


def _same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    return all(
        x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y) for x, y in zip(a, b)
    )


# -- the dry run ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RewardCheck:
    """What one reward function did on the dry run's completions."""

    name: str
    calls: dict[str, Call]  # by completions source ("synthetic", "sampled")
    cause: str | None = None  # why it is broken: raises, wrong-length, none-values, completion-type,
    # special-tokens-stripped, missing-column, constant; timeout (not judged); None: it works (or is sparse)
    why: str = ""
    constant: bool = False  # one value on every completion it scored, though they differ
    stripped_tokens: tuple[str, ...] = ()  # special tokens its source looks for, which TRL's decode strips
    missing_columns: tuple[str, ...] = ()
    values: tuple[float, ...] = ()  # its finite values, every batch
    # Whether it reads its completions (`reads_completions`; None: not asked, or not told): asked of a constant one.
    reads_completions: bool | None = None
    skipped: str | None = None  # not judged, and why (it needs CUDA, ...)

    @property
    def sparse(self) -> bool:
        """One value on every completion tried, though it reads them: zero on these samples, not broken."""
        return self.constant and self.cause is None and self.reads_completions is True

    def describe(self) -> dict[str, Any]:
        """As plain data (what the callback feeds its monitors, the report shows)."""
        return {
            "cause": self.cause,
            "why": self.why,
            "constant": self.constant,
            "sparse": self.sparse,
            "reads_completions": self.reads_completions,
            "distinct": len(set(self.values)),
            "values": sorted(set(self.values))[:8],
            "stripped_tokens": list(self.stripped_tokens),
            "missing_columns": list(self.missing_columns),
            "skipped": self.skipped,
            "seconds": round(sum(c.seconds for c in self.calls.values()), 3),
            "errors": {k: c.error for k, c in self.calls.items() if c.error},
        }


@dataclass(frozen=True)
class DryRun:
    """Every reward function called the way TRL will call it, on completions of the exact shape it passes."""

    checks: list[RewardCheck] = field(default_factory=list)
    batches: dict[str, int] = field(default_factory=dict)  # completions per source
    skipped: list[str] = field(default_factory=list)  # reward functions not called or not judged, and why
    seconds: float = 0.0
    reason: str | None = None  # why nothing was called (no checks then)
    # "preflight": made there and carried over to the callback (:func:`carried_dry_run`).
    origin: str | None = None

    def describe(self) -> dict[str, Any] | str:
        """As plain data; a line saying why when nothing was called."""
        if self.reason is not None:
            return f"skipped: {self.reason}"
        return {
            "functions": {c.name: c.describe() for c in self.checks},
            "completions": dict(self.batches),
            "skipped": list(self.skipped),
            "seconds": round(self.seconds, 3),
            **({"from": self.origin} if self.origin else {}),
        }

    def notes(self) -> list[str]:
        """What the report says of the checks that did not run."""
        if self.reason is not None:
            return [f"the reward dry run was skipped: {self.reason} (reward-function-broken did not run)"]
        return [f"reward dry run: {line}" for line in self.skipped if "reward model" not in line]


def source_of(func) -> str:
    import functools

    while isinstance(func, functools.partial):
        func = func.func
    for candidate in (func, type(func).__call__):  # a function, or a callable object's method
        try:
            return inspect.getsource(candidate)
        except (OSError, TypeError):
            continue
    return ""


def columns_read(func) -> set[str]:
    """The keyword arguments ``func`` needs by name (parameters without a default) or reads from ``**kwargs``
    (``kwargs["x"]``, ``kwargs.get("x")``) that TRL does not pass itself: dataset columns."""
    names: set[str] = set()
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        parameters = ()
    for p in parameters:
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty:
            names.add(p.name)
    source = source_of(func)
    names |= set(re.findall(r"kwargs\[\s*[\"'](\w+)[\"']\s*\]", source))
    names |= set(re.findall(r"kwargs\.get\(\s*[\"'](\w+)[\"']", source))
    return names - set(TRL_ARGUMENTS)


def stripped_tokens(func, tokenizer) -> tuple[str, ...]:
    """Special tokens named in ``func``'s source: ``skip_special_tokens=True`` strips them from every completion."""
    source = source_of(func)
    if not source or tokenizer is None:
        return ()
    special = sorted(set(getattr(tokenizer, "all_special_tokens", ()) or ()), key=len, reverse=True)
    return tuple(t for t in special if len(t) > 2 and t in source)


def dry_run(trainer, batches: Sequence[Completions], *, timeout: float | None = None) -> DryRun:
    """Call each reward function of ``trainer`` on each of ``batches`` (and, when it gives one value on
    conversational completions, on the same completions as plain strings) and judge what it returned
    (:func:`start_dry_run`, waited for)."""
    return start_dry_run(trainer, lambda: batches, timeout=timeout).result()


def start_dry_run(
    trainer,
    batches: Callable[[], Sequence[Completions | None]],
    *,
    timeout: float | None = None,
    alone: str | None = None,
) -> PendingDryRun:
    """The dry run, started: ``batches()`` built, each reward function called on them and judged, all in ONE forked
    child (:class:`hf_sanity.measure.user_code.OneChild`: one fork of the trainer's process, not one a call),
    which works while the caller goes on; :meth:`PendingDryRun.result` waits for its verdicts. Each call there has
    its own time limit (``timeout``, default :data:`REWARD_TIMEOUT`); the judging runs there too, as it decides the
    follow-up calls from the values alone. A function whose call stopped the child (stuck past its limit in C code,
    or ending its process) is judged from that, and the functions after it are not called. ``alone``: the source
    of a batch also judged by itself, from the same calls (:meth:`PendingDryRun.alone`; preflight's verdict on the
    synthetic completions, as SanityCallback's own dry run gives it: :func:`keep_for_training`)."""
    from hf_sanity.measure.user_code import OneChild, can_isolate

    if not can_isolate():
        from hf_sanity.measure.user_code import NO_FORK

        return PendingDryRun(None, [], [], reason=NO_FORK)
    skipped, called = [], []
    for name, func in reward_funcs(trainer):
        if _is_module(func):
            skipped.append(f"{name}: a reward model (not dry-run: it is a model, not code)")
        else:
            called.append((name, func))
    made: dict[str, Any] = {"calls": {}}  # in the child: what the first step built, for the steps after it

    def build():  # in the child, first: the completions, and what every call gets beside them
        made["batches"] = [b for b in batches() if b is not None and len(b)]
        made["state"] = copy.deepcopy(getattr(trainer, "state", None))
        made["tokenizer"] = trainer_tokenizer(trainer)
        made["columns"] = set(getattr(getattr(trainer, "train_dataset", None), "column_names", ()) or ())
        return {b.source: len(b) for b in made["batches"]}

    def step(name, func):  # in the child: the calls, then the verdict (plain data)
        batches, state = made["batches"], made["state"]
        calls = made["calls"][name] = {b.source: call_reward(func, b.kwargs(state), timeout) for b in batches}
        return judge(name, func, calls, batches, state, made["tokenizer"], made["columns"], timeout)

    # In the child: the ``alone`` batch's calls of that function's step, judged by themselves.
    def step_alone(name, func):
        kept = [b for b in made["batches"] if b.source == alone]
        calls = {alone: made["calls"][name][alone]} if kept else {}
        return judge(name, func, calls, kept, made["state"], made["tokenizer"], made["columns"], timeout)

    limit = REWARD_TIMEOUT if timeout is None else timeout
    steps = [build, *(functools.partial(step, name, func) for name, func in called)]
    if alone is not None:
        steps += [functools.partial(step_alone, name, func) for name, func in called]
    return PendingDryRun(OneChild(steps, limit), [name for name, _ in called], skipped, alone=alone)


class PendingDryRun:
    """A dry run at work in its child (:func:`start_dry_run`)."""

    def __init__(
        self, child, names: list[str], skipped: list[str], reason: str | None = None, alone: str | None = None
    ) -> None:
        self.child, self.names, self.skipped, self.reason = child, names, skipped, reason
        self.alone_source = alone  # the source of the batch also judged by itself (:meth:`alone`)

    @property
    def ready(self) -> bool:
        """Its verdicts are in (read without waiting)."""
        return self.child is None or self.child.finished

    def abandon(self) -> None:
        """No verdict is wanted any more (the run was interrupted): its child killed and reaped."""
        if self.child is not None:
            self.child.abandon("not run: the run was interrupted")

    def result(self) -> DryRun:
        """Its verdicts, waiting for its child as long as the calls' limits allow. The completions could not be
        built there (hf-sanity's own code failed): raised, an internal error."""
        if self.child is None:
            return DryRun(reason=self.reason)
        built, judged = self._outcomes()
        return self._run(built, judged[: len(self.names)], built.value)

    def alone(self) -> DryRun | None:
        """The verdicts on the ``alone`` batch by itself (None: none was asked for, or there was no such batch)."""
        if self.child is None or self.alone_source is None:
            return None
        built, judged = self._outcomes()
        size = built.value.get(self.alone_source)
        return self._run(built, judged[len(self.names) :], {self.alone_source: size}) if size else None

    def _outcomes(self):
        built, *judged = self.child.outcomes()
        if not isinstance(built.value, dict):
            raise RuntimeError(f"the dry run's completions were not built: {built.error or built.skipped}")
        return built, judged

    def _run(self, built, judged, completions: dict[str, int]) -> DryRun:
        checks, skipped = [], list(self.skipped)
        for name, outcome in zip(self.names, judged):
            check = outcome.value if isinstance(outcome.value, RewardCheck) else _unjudged(name, outcome)
            if check.skipped:
                skipped.append(f"{name}: {check.skipped}")
            checks.append(check)
        seconds = sum(
            o.seconds for o in (built, *judged)
        )  # the child's work, from the fork to its last verdict
        return DryRun(checks, completions, skipped, seconds)


# -- preflight's verdict, carried over to the callback -----------------------------------------------------------
# SanityCallback's dry run at train begin calls every reward function on the synthetic completions, in a fork of
# the trainer's process (~10-15 ms of a tiny run: issue 29). preflight(trainer=...) has just called them on those
# same completions: it also judges them as the callback would (those completions alone, from the same calls) and
# keeps that verdict here, for as long as the trainer lives. The callback reads it instead of forking only where
# nothing it was judged on can differ: the same reward function objects, dataset and tokenizer, the same
# ``remove_unused_columns``, and no function that reads ``trainer_state`` (preflight's state is not the run's:
# ``max_steps`` is 0 before train() sets it).
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Kept:
    inputs: tuple  # what the verdict was judged on (:func:`_judged_on`)
    run: DryRun


def _judged_on(trainer) -> tuple:
    """What a dry run's verdict depends on, compared by identity: each reward function (name, object), the dataset,
    the tokenizer, and ``remove_unused_columns`` (True, False or None: which columns the calls get)."""
    columns = getattr(getattr(trainer, "args", None), "remove_unused_columns", None)
    return (*(x for pair in reward_funcs(trainer) for x in pair), getattr(trainer, "train_dataset", None),
            trainer_tokenizer(trainer), columns)  # fmt: skip


def reads_trainer_state(func) -> bool:
    """``func`` may read ``trainer_state`` (by name in its signature or its source; True where its source is not
    there to read)."""
    source = source_of(func)
    try:
        names = set(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        names = set()
    return not source or "trainer_state" in source or "trainer_state" in names


def keep_for_training(trainer, run: DryRun | None) -> None:
    """Keep preflight's verdict on the synthetic completions alone (:meth:`PendingDryRun.alone`) for a
    SanityCallback of ``trainer`` (:func:`carried_dry_run`); None, or a function that reads ``trainer_state``:
    nothing kept (and an earlier verdict forgotten)."""
    with contextlib.suppress(TypeError):  # a trainer that cannot be weakly referenced keeps nothing
        _KEPT.pop(trainer, None)
        if (
            run is not None
            and run.reason is None
            and not any(reads_trainer_state(f) for _, f in reward_funcs(trainer))
        ):
            _KEPT[trainer] = _Kept(_judged_on(trainer), replace(run, origin="preflight"))


def carried_dry_run(trainer) -> DryRun | None:
    """The verdict preflight kept for ``trainer`` (:func:`keep_for_training`), if nothing it was judged on has
    changed since; else None (the callback makes its own)."""
    try:
        kept = _KEPT.get(trainer)
    except TypeError:
        return None
    if kept is None:
        return None
    now = _judged_on(trainer)
    same = len(now) == len(kept.inputs) and all(a is b for a, b in zip(now, kept.inputs))
    return kept.run if same else None


def _unjudged(name: str, outcome) -> RewardCheck:
    """A function whose step in the dry run's child gave no verdict: its call stopped the child (past its limit,
    or it ended the process), or an earlier one did and it was not called."""
    if outcome.timed_out:
        return RewardCheck(name=name, calls={}, cause="timeout", why=f"a call {outcome.error}, stuck where its "
                           "timer could not stop it: not judged (a function that calls a service: "
                           "reward_dry_run=False)")  # fmt: skip
    why = outcome.skipped or f"hf-sanity's judging failed (an internal error): {outcome.error}"
    return RewardCheck(name=name, calls={}, skipped=why, why=why)


def on_main_process(compute: Callable[[], Any]) -> Any:
    """``compute()`` on the main process only when torch.distributed runs a group of several (rank 0: a reward
    function that calls a paid service is billed once), its result broadcast to every rank (each reports the
    same verdict). Every rank must call it at the same point; what rank 0 raised is raised on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return compute()
    from hf_sanity.measure.distributed import broadcast

    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = compute()
        except Exception as exc:  # every rank must reach the broadcast
            error = f"{type(exc).__name__}: {exc}"
    result, error = broadcast((result, error))
    if error is not None:
        raise RuntimeError(f"on the main process: {error}")
    return result


def _is_module(func) -> bool:
    try:
        import torch

        return isinstance(func, torch.nn.Module)
    except ImportError:  # pragma: no cover
        return False


def judge(
    name, func, calls: dict[str, Call], batches, state, tokenizer, dataset_columns, timeout
) -> RewardCheck:
    """What went wrong with one reward function, with its cause (see :class:`RewardCheck`)."""
    sizes = {b.source: len(b) for b in batches}
    passed = set(batches[0].rows[0]) if batches and batches[0].rows else set()
    missing = tuple(sorted(columns_read(func) - passed))
    stripped = stripped_tokens(func, tokenizer)
    values = tuple(v for c in calls.values() for v in c.finite())
    base = dict(name=name, calls=calls, stripped_tokens=stripped, missing_columns=missing, values=values)
    for source, call in calls.items():
        if call.skipped:
            return RewardCheck(
                **base, skipped=call.skipped, why=f"on the {source} completions: {call.skipped}"
            )
        if call.timed_out:
            return RewardCheck(**base, cause="timeout", why=f"on the {source} completions it {call.error}: not judged "
                               "(a function that calls a service: reward_dry_run=False)")  # fmt: skip
        if call.error is not None:
            if missing and ("TypeError" in call.error or "KeyError" in call.error):
                dropped = [c for c in missing if c in dataset_columns]
                why = f"it reads {', '.join(map(repr, missing))}, which TRL does not pass it" + (
                    " (the dataset has it, but remove_unused_columns=True removes it)"
                    if dropped
                    else " (no such column in the dataset)"
                )
                return RewardCheck(**base, cause="missing-column", why=f"{why}: {call.error}")
            return RewardCheck(**base, cause="raises", why=f"on the {source} completions: {call.error}")
        if len(call.values) != sizes[source]:
            return RewardCheck(**base, cause="wrong-length",
                               why=f"it returned {len(call.values)} rewards for {sizes[source]} completions")  # fmt: skip
        odd = [v for v in call.values if v is not None and not _number(v)]
        if odd:
            kind = odd[0].type_name if isinstance(odd[0], NotANumber) else type(odd[0]).__name__
            return RewardCheck(**base, cause="raises", why=f"it returned a {kind}, not a number")
        nones = sum(v is None for v in call.values) / max(1, len(call.values))
        if nones > NONE_SHARE:
            return RewardCheck(**base, cause="none-values",
                               why=f"it returned None for {nones:.0%} of the {source} completions (TRL counts "
                               "them as NaN: those completions get no advantage)")  # fmt: skip
    if not values:
        return RewardCheck(**base, cause="none-values", why="it returned no finite reward (NaN or None for every "
                           "completion: TRL gives those completions no advantage)")  # fmt: skip
    differ = len({t for b in batches for t in b.texts}) > 1
    if not differ or len(set(values)) > 1:
        if stripped:
            return RewardCheck(**base, cause="special-tokens-stripped", why=_stripped_why(stripped))
        return RewardCheck(**base)
    # One value for every completion, though they differ.
    constant = dict(base, constant=True)
    conversational = [b for b in batches if b.conversational]
    if conversational:
        as_text = {
            b.source: call_reward(func, b.kwargs(state, as_text=True), timeout) for b in conversational
        }
        varied = {v for c in as_text.values() for v in c.finite()}
        if len(varied) > 1:
            return RewardCheck(**constant, cause="completion-type",
                               why=f"it gives {values[0]:g} to every completion passed as messages "
                               '([{"role": "assistant", "content": ...}], as TRL passes them for conversational '
                               f"prompts) and {len(varied)} different values to the same completions as strings")  # fmt: skip
    if stripped:
        return RewardCheck(**constant, cause="special-tokens-stripped", why=_stripped_why(stripped))
    if missing:
        return RewardCheck(**constant, cause="missing-column",
                           why=f"it reads {', '.join(map(repr, missing))}, which TRL does not pass it")  # fmt: skip
    shown = ", ".join(f"{sizes[s]} {s}" for s in sizes)
    # Constant by construction, or zero on these samples? A function that never reads its completions is the first.
    reads = reads_completions(func, batches[0].kwargs(state), timeout)
    constant = dict(constant, reads_completions=reads)
    said = f"it returned {values[0]:g} for all {shown} completions, which differ in content"
    if reads:
        return RewardCheck(**constant, why=f"{said}, but it reads them: zero on these samples (a sparse reward), "
                           "not constant by construction")  # fmt: skip
    how = (
        "and it does not read them (given completions that fail on any use, it returned the same without touching "
        "them)"
        if reads is False
        else "(whether it reads them could not be told)"
    )
    return RewardCheck(**constant, cause="constant", why=f"{said} {how}")


def _stripped_why(tokens: Sequence[str]) -> str:
    return (f"its source looks for {', '.join(map(repr, tokens))}, which TRL's decode (skip_special_tokens=True) "
            "strips from every completion before the reward function sees it")  # fmt: skip


# -- the pass rate and the groups ------------------------------------------------------------------------------
def total_rewards(per_function: Sequence[Sequence[float | None]], weights: Sequence[float]) -> list[float]:
    """TRL's total reward per completion: the weighted sum of the functions' rewards (NaN where all are None)."""
    out = []
    for values in zip(*per_function):
        given = [(w, float(v)) for w, v in zip(weights, values) if v is not None and math.isfinite(float(v))]
        out.append(sum(w * v for w, v in given) if given else math.nan)
    return out


def group_stds(rewards: Sequence[float], group_size: int) -> list[float]:
    """The standard deviation of each group's rewards, as TRL computes it (NaNs left out, Bessel's correction)."""
    out = []
    for lo in range(0, len(rewards) - group_size + 1, group_size):
        values = [r for r in rewards[lo : lo + group_size] if math.isfinite(r)]
        if len(values) < 2:
            out.append(math.nan)
            continue
        mean = sum(values) / len(values)
        out.append(math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)))
    return out


def uninformative_share(pass_rate: float, group_size: int) -> float:
    """The share of groups expected to hold one reward value for a binary reward passing at ``pass_rate``:
    p^G + (1-p)^G."""
    return pass_rate**group_size + (1 - pass_rate) ** group_size


SIGNAL_SHARE = 0.5  # a group size "gives signal" when more than this share of its groups vary
MAX_GROUP = 1024


def group_size_for_signal(rate: float, share: float = SIGNAL_SHARE) -> int | None:
    """The smallest G whose groups vary with probability above ``share`` for a binary reward passing at ``rate``:
    1 - p^G - (1-p)^G > share (None: none up to :data:`MAX_GROUP`, or a rate of 0 or 1)."""
    if not 0 < rate < 1:
        return None
    return next((g for g in range(2, MAX_GROUP + 1) if 1 - uninformative_share(rate, g) > share), None)


def rate_upper_bound(n: int, confidence: float = 0.95) -> float:
    """The highest pass rate that leaves all of ``n`` independent samples failing with probability
    ``1 - confidence`` (Clopper-Pearson at 0 successes: 1 - (1 - confidence)^(1/n); about 3/n)."""
    return 1 - (1 - confidence) ** (1 / n) if n else 1.0


def pass_rate(rewards: Sequence[float]) -> tuple[bool, float | None]:
    """(binary, share at the higher value): a reward that takes two values, and how often the higher one."""
    finite = [r for r in rewards if math.isfinite(r)]
    distinct = sorted(set(finite))
    if len(distinct) != 2:
        return False, None
    return True, sum(r == distinct[1] for r in finite) / len(finite)


ZERO_STD = 1e-8  # TRL: torch.isclose(std, 0) (atol 1e-8)
TINY_STD = 1e-3  # a group std this small, divided into its advantages, makes noise into +-1


def rollout_summary(trainer) -> dict[str, Any]:
    """The latest generation batch of a running trainer (``trainer._logs``: every completion's reward per function
    and its text, in group order), summarised: the groups' reward spread, which groups carry no signal and why,
    the pass rate of a binary reward, each function's range. Empty when the trainer keeps none."""
    logs = getattr(trainer, "_logs", None)
    group = int(getattr(trainer, "num_generations", 0) or 0)
    rewards = logs.get("rewards") if isinstance(logs, dict) else None
    if not isinstance(rewards, dict) or group < 2:  # none kept, or not as TRL >= 0.24 keeps them
        return {}
    names = [name for name, _ in reward_funcs(trainer)]
    per = [list(rewards.get(name, ())) for name in names]
    n = min((len(v) for v in per), default=0)
    n -= n % group
    if not names or n < group:
        return {}
    per = [v[-n:] for v in per]
    weights = getattr(trainer, "reward_weights", None)
    weights = [float(w) for w in weights.tolist()] if weights is not None else [1.0] * len(names)
    total = total_rewards(per, weights)
    stds = group_stds(total, group)
    texts = [str(c) for c in list(logs.get("completion", ()))[-n:]]
    groups = n // group
    zero = [s <= ZERO_STD for s in stds]
    identical = [len(texts) == n and len(set(texts[g * group : (g + 1) * group])) == 1 for g in range(groups)]
    binary, rate = pass_rate(total)
    finite = [r for r in total if math.isfinite(r)]
    mean = sum(finite) / len(finite) if finite else math.nan
    batch_std = (
        math.sqrt(sum((r - mean) ** 2 for r in finite) / (len(finite) - 1)) if len(finite) > 1 else 0.0
    )
    return {
        "groups": groups,
        "group_size": group,
        "zero_std_groups": sum(zero) / groups,
        "tiny_std_groups": sum(ZERO_STD < s < TINY_STD for s in stds) / groups,
        "identical_groups": sum(identical) / groups,
        "zero_std_differing": sum(z and not i for z, i in zip(zero, identical)) / groups,
        "batch_std": batch_std,
        "binary": binary,
        "pass_rate": rate,
        "functions": {
            name: {"min": min(f), "max": max(f), "mean": sum(f) / len(f)}
            for name, values in zip(names, per)
            if (f := [float(v) for v in values if v is not None and math.isfinite(float(v))])
        },
    }


RATE_PROMPTS, RATE_GROUP = 8, 8  # the larger sample a pass rate is measured on when the first gave one value


@dataclass(frozen=True)
class PassRate:
    """How often a binary reward gives the model's own completions its higher value."""

    passed: int
    completions: int
    values: tuple[float, ...]  # the values seen (one: a sparse reward that never passed)
    sparse: bool = False

    @property
    def rate(self) -> float:
        return self.passed / self.completions if self.completions else 0.0


def scored_sample(trainer) -> list[float] | None:
    """The total reward of :data:`RATE_PROMPTS` x :data:`RATE_GROUP` completions of the model, each reward function
    called in a child process (None when one could not score them all)."""
    drawn = sample(trainer, prompts=RATE_PROMPTS, group_size=RATE_GROUP, seed=1)
    if drawn is None:
        return None
    state = copy.deepcopy(getattr(trainer, "state", None))
    per = []
    for _, func in reward_funcs(trainer):
        if _is_module(func):
            return None
        call = call_reward(func, drawn.completions.kwargs(state))
        if call.values is None or len(call.values) != len(drawn.completions):
            return None
        per.append([v if v is None or _number(v) else None for v in call.values])
    weights = getattr(trainer, "reward_weights", None)
    weights = [float(w) for w in weights.tolist()] if weights is not None else [1.0] * len(per)
    return total_rewards(per, weights[: len(per)])


class Rollouts:
    """What preflight measures of an RL trainer, each part once and only when a rule asks for it: the model's own
    completions for a few prompts (:func:`sample`), the dry run's completions (:func:`synthetic`), and every
    reward function called on both (:func:`dry_run`; not with ``reward_dry_run=False``)."""

    def __init__(self, trainer, *, reward_dry_run: bool = True) -> None:
        self.trainer = trainer
        self.dry_run_enabled = reward_dry_run

    @property
    def group_size(self) -> int:
        return int(getattr(self.trainer, "num_generations", None) or self.trainer.args.num_generations)

    @cached_property
    def sampled(self) -> Sampled | None:
        return sample(self.trainer)

    @cached_property
    def synthetic(self) -> Completions | None:
        return synthetic(self.trainer)

    @cached_property
    def dry_run(self) -> DryRun | None:
        """Every reward function called on the synthetic and the sampled completions, on the main process only
        (:func:`on_main_process`: every rank reaches here through the same rules, in the same order)."""
        if not self.dry_run_enabled or not reward_funcs(self.trainer):
            return None
        try:
            sampled = self.sampled.completions if self.sampled is not None else None
        except Exception:  # this rank's generation failed: its rule says so; the collective must still happen
            sampled = None
        return on_main_process(lambda: self._dry_run([self.synthetic, sampled]))

    def _dry_run(self, batches: list[Completions | None]) -> DryRun:
        """The dry run, waited for; its verdict on the synthetic completions alone kept for a SanityCallback of the
        same trainer (:func:`keep_for_training`: its own dry run would judge exactly that)."""
        pending = start_dry_run(self.trainer, lambda: batches, alone="synthetic")
        run = pending.result()
        keep_for_training(self.trainer, pending.alone())
        return run

    @cached_property
    def continued(self) -> Continued | None:
        """The model's clipped completions generated on past the cap (measured only when a rule asks)."""
        return continue_clipped(self.trainer, self.sampled) if self.sampled is not None else None

    @cached_property
    def measured_pass_rate(self) -> PassRate | None:
        """The pass rate of a binary (or sparse) total reward on the model's own completions. When the dry run's
        ``sampled`` group gave every completion one value, a larger sample is drawn (:data:`RATE_PROMPTS` prompts x
        :data:`RATE_GROUP`) and scored, on the main process only. None: not a binary reward, or not scored."""
        rewards = self.sampled_rewards
        if rewards is None or self.dry_run is None:
            return None
        seen = sorted({r for r in [*rewards, *(self.rewards("synthetic") or ())] if math.isfinite(r)})
        sparse = len(seen) == 1 and any(c.sparse for c in self.dry_run.checks)
        if len(seen) != 2 and not sparse:
            return None
        if len({r for r in rewards if math.isfinite(r)}) == 1:  # all one value: too few to tell a rate by
            larger = on_main_process(lambda: scored_sample(self.trainer))
            if larger is not None:
                rewards = [*rewards, *larger]
                seen = sorted({*seen, *(r for r in larger if math.isfinite(r))})
        if len(seen) > 2:
            return None
        finite = [r for r in rewards if math.isfinite(r)]
        passed = sum(r == seen[1] for r in finite) if len(seen) == 2 else 0
        return PassRate(passed, len(finite), tuple(seen), sparse=len(seen) == 1)

    @cached_property
    def sampled_rewards(self) -> list[float] | None:
        """The total reward of each of the model's own completions (None when the dry run did not score them)."""
        return self.rewards("sampled")

    def rewards(self, source: str) -> list[float] | None:
        """The total reward TRL would give each completion of ``source`` ("sampled", "synthetic"), from the dry
        run's calls (None when a function did not score them all)."""
        run = self.dry_run
        if run is None or source not in run.batches or not run.checks:
            return None
        per = []
        for check in run.checks:
            call = check.calls.get(source)
            if call is None or call.values is None or len(call.values) != run.batches[source]:
                return None
            per.append([v if v is None or _number(v) else None for v in call.values])
        weights = getattr(self.trainer, "reward_weights", None)
        weights = [float(w) for w in weights.tolist()] if weights is not None else [1.0] * len(per)
        return total_rewards(per, weights[: len(per)])


# -- after training: the reward on held-out prompts --------------------------------------------------------------
LAST_SHARE = 0.10  # the training reward: the mean over the last 10% of the logged steps


def held_out_reward(
    samples, dataset, funcs: Sequence[Callable], *, timeout: float | None = None
) -> dict[str, Any]:
    """Each reward function called as TRL calls it (on copies, with a time limit) on the completions generated for
    held-out rows (``samples``: `measure.generate.Sample`, their ``row`` an index into ``dataset``): the mean total
    reward (the functions' sum, TRL's default weights), each function's mean, what broke."""
    rows = [dict(dataset[int(s.row)]) for s in samples]
    batch = Completions(
        rows=rows,
        texts=[s.text for s in samples],
        ids=[list(s.ids) for s in samples],
        conversational=bool(rows) and is_conversational(rows[0].get("prompt")),
        group_size=1,
        source="held-out",
    )
    per, means, errors = [], {}, {}
    for func in funcs:
        name = getattr(func, "__name__", type(func).__name__)
        call = call_reward(func, batch.kwargs(None), timeout)
        if call.skipped:
            errors[name] = f"not called: {call.skipped}"
            continue
        if call.values is None or len(call.values) != len(batch):
            errors[name] = (
                call.error or f"returned {len(call.values or ())} rewards for {len(batch)} completions"
            )
            continue
        values = [v if v is None or _number(v) else None for v in call.values]
        per.append(values)
        finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        means[name] = sum(finite) / len(finite) if finite else None
    total = [r for r in total_rewards(per, [1.0] * len(per)) if math.isfinite(r)] if per else []
    return {"held_out": sum(total) / len(total) if total else None, "functions": means, "errors": errors,
            "completions": len(batch)}  # fmt: skip


def training_reward(source) -> float | None:
    """The reward of a run's last steps: ``source`` is that number, a Trainer's ``log_history`` (a list of log
    dicts), or a ``trainer_state.json`` (or the folder holding it): the mean logged ``reward`` over the last 10% of
    the logged steps that have one (at least one)."""
    import json
    from pathlib import Path

    from hf_sanity.errors import UserInputError

    if source is None:
        return None
    if isinstance(source, numbers.Real):
        return float(source)
    if isinstance(source, (str, Path)):
        path = Path(source)
        path = path / "trainer_state.json" if path.is_dir() else path
        try:
            source = json.loads(path.read_text(encoding="utf-8")).get("log_history", [])
        except (OSError, ValueError) as exc:
            raise UserInputError(f"cannot read the training reward from {str(path)!r}: {exc}") from None
    rewards = [
        float(e["reward"])
        for e in source
        if isinstance(e, dict) and isinstance(e.get("reward"), numbers.Real)
    ]
    if not rewards:
        return None
    last = rewards[-max(1, math.ceil(LAST_SHARE * len(rewards))) :]
    return sum(last) / len(last)
