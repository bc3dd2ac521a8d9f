"""The optimised paths measure what the plain ones do: each shortcut against the straightforward computation
it replaces, on inputs chosen to break it (Unicode case rules, empty texts, odd whitespace)."""

from __future__ import annotations

import pytest

from conftest import REAL_TOKENIZERS, real_tokenizer
from hf_sanity.measure.encode import EncodeOptions, Encoder, normalize, stable_hash
from hf_sanity.measure.markers import WhitespaceIds, _blank
from hf_sanity.testing import build_tokenizer, demo_conversations, tool_conversations
from hf_sanity.testing.factory import TEMPLATES


def whitespace_token_ids(tokenizer) -> frozenset[int]:
    """The whole vocabulary read, id by id: what WhitespaceIds must answer for every id."""
    return frozenset(idx for token, idx in tokenizer.get_vocab().items() if _blank(tokenizer, token, idx))


@pytest.mark.parametrize("template", TEMPLATES)
def test_whitespace_ids_lazy_matches_vocabulary_scan_tiny(template):
    tok = build_tokenizer(template)
    lazy = WhitespaceIds(tok)
    assert {i for i in range(len(tok) + 3) if i in lazy} == whitespace_token_ids(tok)
    assert -100 not in lazy and None not in lazy and [1] not in lazy


@pytest.mark.parametrize(
    "name", sorted(p.name for p in REAL_TOKENIZERS.glob("*") if p.is_dir()) or ["qwen2.5-instruct"]
)
def test_whitespace_ids_lazy_matches_vocabulary_scan_real(name):
    tok = real_tokenizer(name)
    lazy = WhitespaceIds(tok)
    assert {i for i in range(len(tok) + 3) if i in lazy} == whitespace_token_ids(tok)


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "llama3-instruct"])
def test_markers_are_derived_once_per_tokenizer_and_again_when_it_changes(name):
    """derive_markers keeps a tokenizer's markers while what they come from is unchanged, and derives them again
    when its template or special tokens change (each time equal to a derivation from scratch); the kept
    markers do not keep the tokenizer alive."""
    import gc
    import weakref
    from dataclasses import replace

    from hf_sanity.measure.markers import _DERIVED, _derive, derive_markers

    def fresh(markers, tokenizer) -> bool:
        """Equal to markers derived from scratch (the lazy whitespace set aside)."""
        return replace(markers, whitespace_ids=None) == replace(_derive(tokenizer), whitespace_ids=None)

    tok = real_tokenizer(name)
    first = derive_markers(tok)
    assert derive_markers(tok) is first and fresh(first, tok)
    assert first.end_of_turn
    tok.chat_template = tok.chat_template.replace("assistant", "helper")  # the generation prompt changes
    changed = derive_markers(tok)
    assert changed is not first and fresh(changed, tok)
    assert replace(changed, whitespace_ids=None) != replace(first, whitespace_ids=None)
    tok.add_special_tokens({"additional_special_tokens": ["<|turn_closed|>"]})
    assert derive_markers(tok) is not changed
    assert {k for k in _DERIVED if k is tok} == {tok}
    gone = weakref.ref(tok)
    del tok, first, changed
    gc.collect()
    assert gone() is None


TRICKY = [
    "ΟΔΟΣ ΣΟΦΟΣ: Σ",  # Greek final sigma depends on what follows a capital sigma
    "  leading and trailing  \n\t",
    "",
    "İstanbul ǅemal ß ﬁ",  # lowercases that change length
    "a\u00a0non-breaking\u2003em\u3000ideographic\x1cfile-separator\u2028line",
    "the answer is the answer is the answer is the answer",
]


def _rows():
    rows = demo_conversations(24) + tool_conversations(6)
    for k, text in enumerate(TRICKY):
        answer = TRICKY[(k + 5) % len(TRICKY)] or "ΣΟΦΟΣ and more than twenty characters"
        system = [{"role": "system", "content": text}] if text.strip() else []
        rows.append(
            {
                "messages": [
                    *system,
                    {"role": "user", "content": f"{text} {answer} ΑΣ"},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"ΣΑΣ{text}"},
                    {"role": "assistant", "content": f"{answer}  {text}"},
                ]
            }
        )
    return rows


def _reference_leaks(encoder, messages):
    from hf_sanity.measure.encode import text_of

    texts = [(m["role"], text_of(m)) for m in messages]
    answers = [
        (" ".join(t for r, t in texts[:j] if r != "assistant"), text)
        for j, (role, text) in enumerate(texts)
        if role == "assistant"
    ]
    return texts, encoder._leaks(answers)


def test_conversation_hash_and_leak_match_normalizing_the_joined_texts():
    """Each text is split into words once; the hash and the leak measure equal those of the joined texts."""
    tok = build_tokenizer("chatml")
    encoder = Encoder(tok, EncodeOptions(fmt="messages"))
    leaks = 0
    for row in _rows():
        out = encoder.encode(row)
        assert out["error"] == ""
        texts, (ratio, after) = _reference_leaks(encoder, row["messages"])
        assert out["hash"] == stable_hash(normalize(" ".join(f"{role}: {text}" for role, text in texts)))
        assert (out["leak"], out["leak_after"]) == (ratio, after)
        leaks += ratio > 0
    assert leaks >= 3  # the answers pasted into the prompts were found


def test_batched_call_matches_row_by_row():
    """`datasets.map` calls the encoder on batches (with the cyclic collector paused): same rows out."""
    import gc

    tok = build_tokenizer("chatml")
    encoder = Encoder(tok, EncodeOptions(fmt="messages", max_len=64))
    rows = _rows()
    batch = encoder({"messages": [r["messages"] for r in rows]})
    assert gc.isenabled()
    for k, row in enumerate(rows):
        single = encoder.encode(row)
        assert {key: values[k] for key, values in batch.items()} == single


REAL_NAMES = sorted(p.name for p in REAL_TOKENIZERS.glob("*") if p.is_dir())


@pytest.mark.parametrize("name", [f"tiny-{t}" for t in TEMPLATES] + REAL_NAMES)
def test_ids_without_offsets_are_the_tokenizers_own(name):
    """The marker method tokenizes through the backend's `encode_batch_fast` (no offsets tracked): the ids the
    tokenizer's own call gives, on rendered conversations (tool calls included) and odd texts."""
    from hf_sanity.measure.encode import offsetless_ids

    tok = build_tokenizer(name.removeprefix("tiny-")) if name.startswith("tiny-") else real_tokenizer(name)
    texts = list(TRICKY) + ["<|im_start|>user\nhi<|im_end|>\n", " " * 40 + "x", "\n\n\t\t"]
    if tok.chat_template:
        for row in _rows():
            try:
                texts.append(tok.apply_chat_template(row["messages"], tokenize=False, tools=row.get("tools")))
            except Exception:  # a template that rejects a row's roles or tools: not this test's business
                continue
    assert offsetless_ids(tok, texts) == tok(texts, add_special_tokens=False)["input_ids"]


def test_the_marker_method_tokenizes_without_offsets_after_calibration_with_the_same_rows_out():
    tok = build_tokenizer("chatml")
    rows = _rows()
    fast, plain = (
        Encoder(tok, EncodeOptions(fmt="messages", max_len=64)),
        Encoder(tok, EncodeOptions(fmt="messages", max_len=64)),
    )
    fast.calibrate(rows[:16])
    plain.calibrate(rows[:16])
    plain.fast_ids = False
    assert fast.fast_ids and not fast.exact
    assert fast.encode_rows(rows) == plain.encode_rows(rows)


@pytest.mark.parametrize(
    "rows",
    [
        [{"messages": r["messages"]} for r in demo_conversations(40)],
        [{"text": f"plain text number {i}"} for i in range(10)],
        [{"input_ids": [5, 6, 7 + i], "labels": [-100, 6, 7 + i]} for i in range(10)],
    ],
    ids=["messages", "text", "tokens"],
)
def test_scan_hands_datasets_the_columns_it_would_build(rows):
    """The scan passes its columns to datasets as one typed Arrow table: the values of datasets' own
    inference from the encoder's lists, and its types where it could infer one (not from empty lists)."""
    import datasets

    from hf_sanity.measure.context import Context
    from hf_sanity.measure.formats import detect_format

    tok = build_tokenizer("chatml")
    data = datasets.Dataset.from_list(rows)
    fmt = detect_format(data.column_names, None)
    ctx = Context(tokenizer=tok, dataset=data, fmt=fmt, options=EncodeOptions(fmt=fmt))
    plain = data.map(ctx.encoder, batched=True, batch_size=16, remove_columns=data.column_names)
    assert ctx.encoded.to_list() == plain.to_list()
    ours, theirs = ctx.encoded.data.schema, plain.data.schema
    assert ours.names == theirs.names
    for name in ours.names:
        if "null" not in str(theirs.field(name).type):
            assert ours.field(name).type == theirs.field(name).type, name


def test_list_column_first_filled_after_the_first_batch():
    """A stray marker first seen after the first 256 rows: datasets alone would have typed the column from
    the first batch (all empty: list<null>) and failed to write it."""
    from helpers import run
    from hf_sanity.testing import synthetic_conversations

    rows = synthetic_conversations(300)
    rows[280]["messages"][-2]["content"] += " <|im_start|> stray"
    report = run(build_tokenizer("chatml"), rows, select=["stray-template-markers"])
    assert [f.rule for f in report.findings] == ["stray-template-markers"]


def _reference_graph_tensors(roots, *, depth=4, limit=200_000):
    """graph_tensors as it was, with every path spelled out as it is walked."""
    import collections

    import torch

    from hf_sanity.training.memory import _ATOMS, _library_class

    found, seen, counted = {}, set(), set()
    stack = [(name, obj, 0) for name, obj in roots]
    visited = 0
    while stack and visited < limit:
        path, obj, level = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        visited += 1
        if isinstance(obj, torch.Tensor):
            if obj.grad_fn is not None and id(obj) not in counted:
                counted.add(id(obj))
                holder = path.rsplit("[", 1)[0]
                found[holder] = found.get(holder, 0) + 1
            continue
        if level >= depth or isinstance(obj, _ATOMS):
            continue
        if isinstance(obj, dict):
            stack.extend((f"{path}[{k!r}]", v, level + 1) for k, v in list(obj.items())[:10_000])
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend((f"{path}[{i}]", v, level + 1) for i, v in enumerate(list(obj)[:10_000]))
        elif isinstance(obj, torch.nn.Module):
            attrs = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
            stack.extend((f"{path}.{k}", v, level + 1) for k, v in attrs.items())
            stack.extend((f"{path}.{k}", v, level) for k, v in obj.named_children())
        elif isinstance(obj, torch.optim.Optimizer):
            continue
        elif hasattr(obj, "__dict__") and (level == 0 or not _library_class(type(obj))):
            stack.extend((f"{path}.{k}", v, level + 1) for k, v in vars(obj).items())
    return found


def test_graph_walk_finds_what_the_spelled_out_walk_found():
    """The memory walk spells a path only for a tensor it finds: the same holders, counts and cut-offs."""
    import collections
    from types import SimpleNamespace

    import torch

    from hf_sanity.training.memory import graph_tensors

    w = torch.ones(3, requires_grad=True)

    def graph():
        return w * 2

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
    model[1].kept = graph()
    model.cache = {"hidden": graph(), ("a", 1): [graph(), 3]}
    shared = graph()
    state = SimpleNamespace(
        log_history=[{"loss": 1.0}, {"loss": graph(), "lr": 0.1}, {"x": [[[[graph()]]]]}],
        window=collections.deque([graph(), shared]),
        plain=w.detach(),
    )
    trainer = SimpleNamespace(
        model=model, state=state, again=shared, opt=torch.optim.SGD([w], lr=0.1), bag={frozenset({1})}
    )
    trainer.me = trainer
    roots = [("trainer", trainer), ("globals", {"leak": graph(), "shared": shared, "t": (graph(),)})]
    for depth in (2, 3, 4, 6):
        for limit in (1, 5, 17, 40, 200_000):
            assert graph_tensors(roots, depth=depth, limit=limit) == _reference_graph_tensors(
                roots, depth=depth, limit=limit
            ), (depth, limit)
    assert sum(graph_tensors(roots).values()) >= 6


def test_median_of_a_short_list_is_numpys_to_the_bit():
    import math
    import random

    import numpy as np

    from hf_sanity.numbers import median

    rng = random.Random(0)
    specials = [math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308, 5e-324, 2**60 + 1, 3]
    for _ in range(3000):
        n = rng.randint(1, 60)
        values = [rng.choice([rng.gauss(0, 1), rng.gauss(3, 1e-9), rng.choice(specials)]) for _ in range(n)]
        if rng.random() < 0.05:
            values[rng.randrange(n)] = math.nan
        with np.errstate(all="ignore"):
            expected = float(np.median(values))
        got = median(values)
        assert got == expected or (math.isnan(got) and math.isnan(expected)), values
    assert median([np.float32(1.0), np.float32(2.0)]) == 1.5  # numpy scalars go to numpy


def _windows():
    import math
    import random

    rng = random.Random(1)
    for _ in range(2000):
        n = rng.randint(8, 40)
        level = rng.choice([2.5, 1e-3, -1.0, 0.0, 7.0])
        kind = rng.random()
        if kind < 0.3:  # flat with noise
            yield [
                level + rng.gauss(0, abs(level) * rng.choice([1e-4, 1e-3, 1e-2, 0.05]) + 1e-12)
                for _ in range(n)
            ]
        elif kind < 0.6:  # trending
            yield [level + rng.choice([-1, 1]) * 0.01 * i * rng.random() for i in range(n)]
        elif kind < 0.8:  # oscillating around a level
            yield [level + (0.3 if i % 2 else -0.3) * level for i in range(n)]
        else:  # with specials
            w = [level + rng.gauss(0, 1e-3) for _ in range(n)]
            w[rng.randrange(n)] = rng.choice([math.nan, math.inf, -math.inf, 0.0])
            yield w


def test_noise_of_a_short_list_is_numpys_to_the_bit():
    """loss-flat's trend test measures the noise of its last losses at every step, on a list."""
    import numpy as np

    from hf_sanity.numbers import noise

    for window in _windows():
        with np.errstate(all="ignore"):
            expected = noise(np.asarray(window, dtype=float))
        got = noise(list(window))
        assert got == expected or (np.isnan(got) and np.isnan(expected)), window


def test_is_flat_on_a_list_answers_as_on_an_array():
    """The step detectors pass lists (Python medians, an early exit); doctor passes arrays (numpy)."""
    import numpy as np

    from hf_sanity.measure.curves import is_flat
    from hf_sanity.rules.training.updates import FLAT_MIN_POINTS, FLAT_REL, FLAT_SWING

    answers = set()
    for window in _windows():
        kw = dict(rel=FLAT_REL, swing=FLAT_SWING, min_points=FLAT_MIN_POINTS)
        with np.errstate(all="ignore"):
            expected = is_flat(np.asarray(window, dtype=float), **kw)
        assert is_flat(list(window), **kw) == expected, window
        answers.add(expected)
    assert answers == {True, False}


def test_update_monitor_findings_match_filtering_every_loss_at_every_step():
    """loss-flat's online test fits the trend of every loss since warmup from running sums, counts the update
    ratios since warmup as they arrive, reads the last losses from the tail of the history (the losses arrive
    in step order) and keeps the first blow-up as the losses arrive, instead of filtering and refitting the
    whole history at every step."""
    import math
    import random

    import numpy as np

    from hf_sanity.numbers import noise
    from hf_sanity.rules.training import updates
    from hf_sanity.rules.training.updates import ONLINE_FLAT_STEPS, UpdateMonitor, flat

    class Reference(UpdateMonitor):
        def _flat_curve(self, step):
            after = [(s, v) for s, v in self._losses if s > self.warmup_steps]
            if len(after) < ONLINE_FLAT_STEPS:
                return []
            values = [v for _, v in self._losses[-ONLINE_FLAT_STEPS:]]
            if self._diverged_before(self._losses[-ONLINE_FLAT_STEPS][0]) is not None:
                return (
                    self._fire_flat(self._losses[-ONLINE_FLAT_STEPS][0], step, "diverged")
                    if flat(values)
                    else []
                )
            start = updates.median([v for _, v in self._losses[:3]])
            level = updates.median(values)
            if abs(level - start) > updates.STARTING_LEVEL * abs(start):
                return []
            ratios = [r for s, r in self._ratios if s > self.warmup_steps]
            if not ratios:
                return []
            still = sum(r < updates.FLAT_LOW_RATIO for r in ratios) > len(ratios) / 2
            x = np.array([s for s, _ in after], dtype=float)
            slope, _ = np.polyfit(x, np.array([v for _, v in after]), 1)
            error = noise(values) / math.sqrt(float(((x - x.mean()) ** 2).sum()))
            rate = updates.FLAT_RATE_STILL if still else updates.FLAT_RATE
            if slope - updates.FLAT_SE * error <= -rate * abs(level):
                return []
            first = after[0][0]
            fitted = {"change_per_100_steps": 100 * slope / abs(level), "slope_error": error}
            ratio = updates.median([r for s, r in self._ratios if s >= first])
            if still:
                return self._fire_flat(first, step, "lr-too-low", update_ratio=ratio, **fitted)
            chance = math.log(self.vocab_size)
            if level < updates.NOT_LEARNABLE_LEVEL * chance:
                return []
            healthy = sum(r < updates.HEALTHY_RATIO for r in ratios) <= len(ratios) / 2
            cause = "loss-not-learnable" if healthy else "lr-too-low-or-not-learnable"
            return self._fire_flat(first, step, cause, update_ratio=ratio, chance=chance, **fitted)

        def _diverged_before(self, first):  # the whole history scanned at every call
            from hf_sanity.rules.training.divergence import START_POINTS, diverge_threshold

            if len(self._losses) <= START_POINTS:
                return None
            start = updates.median([v for _, v in self._losses[:START_POINTS]])
            threshold = diverge_threshold(start, self.vocab_size)
            return next((s for s, v in self._losses if s < first and v > threshold), None)

    def same(a, b) -> bool:  # the fitted numbers agree to rounding (running sums vs a fresh fit)
        return (a.rule, a.step, a.evidence.keys()) == (b.rule, b.step, b.evidence.keys()) and all(
            v
            == (pytest.approx(b.evidence[k], rel=1e-6, abs=1e-12) if isinstance(v, float) else b.evidence[k])
            for k, v in a.evidence.items()
        )

    rng = random.Random(2)
    fired = 0
    for trial in range(300):
        warmup = rng.choice([0, 5, 30])
        ratio = rng.choice([1e-6, 3e-4, 1e-3])
        steps = rng.randint(20, 120)
        kind = trial % 4
        records = []
        for s in range(1, steps + 1):
            if kind == 0:
                loss = 6.9 + rng.gauss(0, 1e-3)  # never moves
            elif kind == 1:
                loss = 6.9 * math.exp(-s / 30) + rng.gauss(0, 1e-2)  # learns
            elif kind == 2:
                loss = 6.9 if s < 10 else (60.0 if s < 14 else 6.9 + rng.gauss(0, 1e-3))  # blows up, dies
            else:
                loss = rng.choice([6.9, math.nan]) if s % 17 == 0 else 6.9 + rng.gauss(0, 1e-3)
            values = {"loss": loss, "loss_finite": math.isfinite(loss), "lr": 1e-4}
            if s <= 10 or s % 10 == 0:
                values["update_ratio"] = ratio
            records.append((s, values))
        ours, theirs = (
            UpdateMonitor(warmup_steps=warmup, vocab_size=1000),
            Reference(warmup_steps=warmup, vocab_size=1000),
        )
        for s, values in records:
            a, b = ours.update(s, values), theirs.update(s, values)
            assert len(a) == len(b) and all(same(x, y) for x, y in zip(a, b)), (trial, s, a, b)
            fired += bool(a)
    assert fired >= 50


def test_update_ratio_on_the_cpu_is_the_tensor_computation():
    """On the CPU the update ratio of a few sampled tensors is computed in Python: the same numbers as the
    tensor operations that run on an accelerator (NaN, zero norms, even counts: torch's lower median)."""
    import math

    import torch

    from hf_sanity.training.measures import update_ratio

    def on_device(sums):  # what runs on an accelerator, without a transfer
        diff, norm = sums[:, 0].sqrt(), sums[:, 1].sqrt()
        ratio = torch.where(norm > 0, diff / norm.clamp_min(1e-30), torch.full_like(diff, math.nan))
        return ratio.nanmedian().item(), bool(((diff > 0) | diff.isnan()).any())

    gen = torch.Generator().manual_seed(0)
    cases = [torch.rand(k, 2, generator=gen) ** 4 for k in (1, 2, 3, 4, 7)]
    cases += [
        torch.tensor([[0.0, 0.0], [0.0, 0.0]]),  # no norm anywhere: NaN, nothing moved
        torch.tensor([[math.nan, 1.0], [1e-4, 1.0]]),  # NaN weights changed
        torch.tensor([[0.0, 1.0]] * 3),  # nothing moved
        torch.tensor([[1e-8, 4.0], [4e-6, 1.0], [0.0, 9.0], [1e-6, 0.0]]),  # a zero-norm tensor left out
    ]
    for sums in cases:
        ratio, updated = update_ratio(sums)
        expected, expected_updated = on_device(sums)
        assert updated == expected_updated
        assert (math.isnan(ratio) and math.isnan(expected)) or ratio == pytest.approx(expected, rel=1e-6)


def test_recorder_on_the_cpu_keeps_what_a_device_copy_keeps():
    """On the CPU a pushed tensor is written into the float32 buffer through numpy, without a tensor op."""
    import math

    import torch

    from hf_sanity.training.recorder import EarlyFlags, Recorder

    values = [
        torch.tensor(1.0000000001, dtype=torch.float64),  # rounds to float32
        torch.tensor(3.3, dtype=torch.bfloat16),
        torch.tensor(-2.5, dtype=torch.float16),
        torch.tensor(True),
        torch.tensor([7.25]),
        torch.tensor([[0.1, 9.0]]),
        torch.tensor(math.inf),
        torch.tensor(-math.inf),
        torch.tensor(math.nan),
        torch.tensor(1e39, dtype=torch.float64),  # beyond float32: inf
        torch.tensor(5, dtype=torch.int64),
        torch.tensor([]),
        torch.tensor(2.0, requires_grad=True) * 3,
    ]
    recorder = Recorder(capacity=4)  # grows twice
    for value in values:
        recorder.push(1, "x", value)
    got = recorder.read()[1]["x"]
    expected = []
    for value in values:
        slot = torch.zeros(1, dtype=torch.float32)
        v = value.detach()
        slot[0].copy_(v.reshape(-1)[0] if v.numel() else v.new_zeros(()))
        expected.append(slot.tolist()[0])
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a == b or (math.isnan(a) and math.isnan(b)), (a, b)
    flags = EarlyFlags()
    for micro, value in enumerate(values[:-2]):
        flags.mark(1, micro, value)
    assert flags.nonfinite() == (1, 6)
    # The loss read on the host by the push marks the step as the tensor does.
    flags, fresh = EarlyFlags(), Recorder()
    for micro, value in enumerate(values[:-2]):
        host = fresh.push(1, "loss", value)
        kept = fresh.read()[1]["loss"][-1]
        assert host is None or host == kept or (math.isnan(host) and math.isnan(kept))
        flags.mark(1, micro, value, host=host)
    assert flags.nonfinite() == (1, 6)
    flags.mark(2, 0, torch.tensor([1.0, math.nan]))
    assert flags.nonfinite() == (2, 0)


def test_labels_counted_at_the_read_as_batch_by_batch():
    import torch

    from hf_sanity.training.measures import count_labels

    gen = torch.Generator().manual_seed(0)
    batches = []
    for k in range(9):
        labels = torch.randint(0, 50, (3, 5 + k), generator=gen)
        labels[labels % 4 == 0] = -100
        batches.append(labels)
    batches += [torch.ones(4), torch.tensor([1, 2, 3]), torch.rand(2, 3)]  # not counted: 1-D or float
    one_by_one, at_once = torch.zeros(40), torch.zeros(40)  # ids beyond the vector are clamped into it
    for labels in batches:
        count_labels(one_by_one, labels)
    count_labels(at_once, batches)
    assert torch.equal(one_by_one, at_once) and one_by_one.sum() > 0


def test_the_memory_walk_keeps_to_its_share_of_the_run():
    """The walk (and the predictions probe where it runs alone) runs its first checks whatever they cost, then
    only while it has cost at most its share of the time since its first run: at 0.5%, a walk of 1 s is due
    again 200 s later, not before."""
    from hf_sanity.training.budget import Budget

    now = [0.0]
    budget = Budget(share=0.005, free=2, clock=lambda: now[0])

    def walk(seconds):
        assert budget.due()
        with budget.spend():
            now[0] += seconds

    walk(1.0)
    walk(1.0)  # the free runs: due however much they cost
    now[0] = 300.0  # 2 s spent, 0.5% of 300 s is 1.5 s: not yet
    assert not budget.due() and budget.skipped == 1
    now[0] = 400.0  # 0.5% of 400 s is 2 s: due again
    walk(0.001)
    assert (budget.runs, budget.skipped) == (3, 1)


def test_probes_keep_to_their_budget_alone_and_to_the_interval_under_sharded_parameters():
    """Alone, a predictions probe is due at its interval only while probes have cost at most their share of
    the run; under sharded parameters (its forward gathers every rank's shards) at every interval, whatever
    it costs, so every rank probes at the same steps."""
    from hf_sanity.training.budget import Budget
    from hf_sanity.training.first_batch import FirstBatch

    class Sink:  # every check enabled: every value is measured
        wants = staticmethod(lambda *slugs: True)
        measures = staticmethod(lambda *keys: True)

    now = [0.0]
    first = FirstBatch()
    first.budget = Budget(share=0.005, free=3, clock=lambda: now[0])
    assert not first.probe_due(50, 50, Sink())  # no probe batch yet (the first forward keeps it)
    first._probe_batch = {}
    for step in (50, 100, 150):  # the free probes, 1 s each
        assert first.probe_due(step, 50, Sink())
        with first.budget.spend():
            now[0] += 1.0
    now[0] = 300.0  # 3 s spent, 0.5% of 300 s is 1.5 s
    assert not first.probe_due(200, 50, Sink()) and not first.probe_due(199, 50, Sink(), sharded=True)
    assert first.probe_due(200, 50, Sink(), sharded=True)
    now[0] = 700.0  # 0.5% of 700 s is 3.5 s: due again
    assert first.probe_due(250, 50, Sink())


def test_the_strided_sample_of_a_large_tensor_reads_its_update_ratio():
    """A tensor over UPDATE_SAMPLE_ELEMENTS is read on an evenly strided sample: the update ratio it gives is the
    whole tensor's, for a dense AdamW-like update and for an embedding whose last rows alone moved (new tokens
    trained: a sample of the first rows would read no update at all)."""
    import torch

    from hf_sanity.measure.tensors import strided
    from hf_sanity.training.measures import UPDATE_SAMPLE_ELEMENTS, update_ratio, update_squares

    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(1024, 256, generator=gen) * 0.02  # 8x the sample
    dense = weights - 1e-3 * torch.sign(torch.randn(weights.shape, generator=gen))
    rows = weights.clone()
    rows[-64:] -= 1e-3 * torch.sign(torch.randn(rows[-64:].shape, generator=gen))
    for after in (dense, rows):
        whole, _ = update_ratio(update_squares([after], [weights]))
        sample = [strided(after, UPDATE_SAMPLE_ELEMENTS)]
        assert sample[0].numel() <= UPDATE_SAMPLE_ELEMENTS
        sampled, _ = update_ratio(update_squares(sample, [strided(weights, UPDATE_SAMPLE_ELEMENTS)]))
        assert sampled == pytest.approx(whole, rel=0.03), (sampled, whole)


def test_update_squares_with_foreach_kernels_are_the_per_tensor_sums():
    """The update's and the old weights' sums of squares, computed per list with `foreach` kernels, equal the
    per-tensor computation (bf16 and empty parts included)."""
    import torch

    from hf_sanity.training.measures import update_squares
    from hf_sanity.training.shards import squares

    gen = torch.Generator().manual_seed(0)
    before = [
        torch.randn(5, 3, generator=gen),
        torch.randn(7, generator=gen).to(torch.bfloat16),
        torch.zeros(0),
        torch.randn(3000, generator=gen),
    ]
    after = [t + 0.01 * torch.randn(t.shape, generator=gen).to(t.dtype) for t in before]
    expected = torch.stack(
        [torch.stack([squares(now.float() - old.float()), squares(old)]) for now, old in zip(after, before)]
    )
    assert torch.allclose(update_squares(after, before), expected, rtol=1e-6, atol=0)
    # Consuming a snapshot of ours (written into the last one's buffers): the same sums, no new buffers.
    from hf_sanity.training.measures import snapshot

    buffers = snapshot(before)
    again = snapshot(before, into=buffers)
    assert all(a is b for a, b in zip(again, buffers))
    assert torch.allclose(update_squares(after, again, consume=True), expected, rtol=1e-6, atol=0)
