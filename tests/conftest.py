"""Shared fixtures. Tests never touch the network: the Hub is switched off before anything imports it."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_SANITY_CACHE", os.path.join(os.path.dirname(__file__), "..", ".cache", "hf-sanity"))

import tempfile
from pathlib import Path

import pytest

# The real model families' tokenizers: ../shared/real-tokenizers beside the checkout, or the folder
# HF_SANITY_REAL_TOKENIZERS names. Without them their tests skip, loudly: the header and the summary say so.
REAL_TOKENIZERS = Path(
    os.environ.get("HF_SANITY_REAL_TOKENIZERS")
    or Path(__file__).resolve().parents[2] / "shared" / "real-tokenizers"
).expanduser()
ABSENT = "real tokenizers absent"
GUARD_RULES = {"internal-error", "checks-skipped"}  # the runner's own, around every detector


def _real_tokenizer_families() -> list[str]:
    return sorted(p.name for p in REAL_TOKENIZERS.glob("*") if p.is_dir()) if REAL_TOKENIZERS.is_dir() else []


def pytest_report_header(config):
    families = _real_tokenizer_families()
    if families:
        return f"real tokenizers: {REAL_TOKENIZERS} ({len(families)}: {', '.join(families)})"
    return (
        f"real tokenizers: ABSENT at {REAL_TOKENIZERS}: the tests that need them skip; put the shared "
        "real-tokenizers folder there or set HF_SANITY_REAL_TOKENIZERS=<folder>"
    )


def pytest_terminal_summary(terminalreporter):
    """Tests skipped for want of the real tokenizers are counted at the end, where no one misses them."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if ABSENT in str(r.longrepr)]
    if skipped:
        terminalreporter.section(ABSENT, sep="!", red=True, bold=True)
        terminalreporter.write_line(
            f"{len(skipped)} test(s) skipped: no real tokenizers at {REAL_TOKENIZERS} (their parity and "
            "real-template checks did not run); set HF_SANITY_REAL_TOKENIZERS=<folder> to run them",
            red=True,
            bold=True,
        )


def pytest_collection_finish(session):
    """Every test module is imported: what the imports built (torch, transformers, TRL, the test modules) is moved
    out of the cyclic collector's reach. accelerate ends every `Trainer.train()` with a full `gc.collect()`,
    which otherwise walks those millions of objects each time (a quarter of the in-process suite's time). The
    collector still runs and frees what the tests make; only the objects alive now are never collected."""
    import gc

    gc.collect()
    gc.freeze()


# -- clean markers are honest ---------------------------------------------------------------------------
def unrun(selectors, ran: set[str]) -> list[str]:
    """The selectors of a ``@pytest.mark.clean(...)`` that nothing in ``ran`` (the rules whose detectors ran)
    answers: a rule slug whose detector did not run, a stage none of whose rules' detectors ran, ALL with
    none run. The runner's own rules (internal-error, checks-skipped) are answered by any detector that ran."""
    from hf_sanity import catalog

    rules = catalog.load()
    out = []
    for selector in selectors:
        if selector == "ALL" or selector in GUARD_RULES:
            answered = bool(ran)
        elif selector in catalog.STAGES:
            answered = any(rules[slug].stage == selector for slug in ran if slug in rules)
        else:
            answered = selector in ran
        if not answered:
            out.append(selector)
    return out


RAN = pytest.StashKey[set]()


def _recorded(item):
    """A generator for a hook wrapper: the rules whose detectors ran in its phase (in this process, and in
    the processes it starts, through HF_SANITY_RECORD_RAN) are added to ``item``'s record."""
    from hf_sanity import catalog

    handle, log = tempfile.mkstemp(prefix="hf-sanity-ran-", suffix=".txt")
    os.close(handle)
    outer = os.environ.get("HF_SANITY_RECORD_RAN")
    os.environ["HF_SANITY_RECORD_RAN"] = log
    try:
        with catalog.recording() as ran:
            result = yield
        ran |= set(Path(log).read_text(encoding="utf-8").split())
        item.stash.setdefault(RAN, set()).update(ran)
    finally:
        if outer is None:
            os.environ.pop("HF_SANITY_RECORD_RAN", None)
        else:
            os.environ["HF_SANITY_RECORD_RAN"] = outer
        os.unlink(log)
    return result


_FIXTURE_RAN: dict[int, set[str]] = {}  # id(fixturedef) -> what its last setup ran


class _Ran:
    """Where :func:`_recorded` files what ran: a test item's stash, or a fixture's entry."""

    def __init__(self, key: int) -> None:
        self.stash = {}
        self.key = key

    def store(self) -> None:
        _FIXTURE_RAN[self.key] = self.stash.get(RAN, set())


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A run made once for a module or the session (torchrun's scenarios, a fine-tuned fixture) counts for
    every clean test that reads it: what its setup ran is kept with the fixture."""
    if fixturedef.scope == "function":
        return (yield)
    holder = _Ran(id(fixturedef))
    try:
        return (yield from _recorded(holder))
    finally:
        holder.store()


def _fixtures_ran(item) -> set[str]:
    out: set[str] = set()
    for defs in item._fixtureinfo.name2fixturedefs.values():
        for fixturedef in defs:
            out |= _FIXTURE_RAN.get(id(fixturedef), set())
    return out


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """A clean test's function fixtures (a run it reads the report of) count as the test's own."""
    if item.get_closest_marker("clean") is None:
        return (yield)
    return (yield from _recorded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test marked ``@pytest.mark.clean(...)`` proves a rule silent only where the rule's detector ran: the
    catalog's runner records which ran (during the test and its function fixtures, in this process and the
    processes they start), and a marked rule that did not run fails the test. Costs nothing extra: no
    detector is run for it. (A test reading a run made once for several tests notes what that run ran,
    from its report, with ``catalog.note_ran``.)"""
    marker = item.get_closest_marker("clean")
    if marker is None:
        return (yield)
    result = yield from _recorded(item)
    ran = item.stash.get(RAN, set()) | _fixtures_ran(item)
    report = os.environ.get("HF_SANITY_RAN_REPORT")  # for a person fixing markers: what each test ran
    if report:
        with open(report, "a", encoding="utf-8") as out:
            out.write(f"{item.nodeid}\t{' '.join(sorted(ran))}\n")
    missing = unrun(marker.args, ran)
    if missing:
        pytest.fail(
            f"@pytest.mark.clean names {', '.join(missing)}, whose detector did not run in this test (not "
            "written for its objective, not applicable, or not selected): a clean test must run the check it "
            "says stays silent",
            pytrace=False,
        )
    return result


@pytest.fixture(autouse=True)
def _seeded():
    """Each test starts from one RNG state: torch seeds every process differently, so a test that draws weights
    (a LoRA's A matrices, a fresh layer) without seeding them saw other weights at every run and in every order
    of the suite."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_user_config(monkeypatch, tmp_path):
    """Run each test from an empty folder, so no pyproject.toml [tool.hf-sanity] leaks into it."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _no_internal_error(request, monkeypatch):
    """A check that breaks in any test is a failure of that test, whatever the test asserts: every
    `internal-error` finding made in-process is recorded and fails it (tests of the guard itself are marked
    ``@pytest.mark.internal_error_expected``)."""
    from hf_sanity import catalog

    made = []
    real = catalog.internal_error

    def recording(check, exc, step=None):
        finding = real(check, exc, step)
        made.append(finding.message)
        return finding

    monkeypatch.setattr(catalog, "internal_error", recording)
    yield
    if made and request.node.get_closest_marker("internal_error_expected") is None:
        pytest.fail(f"{len(made)} internal-error finding(s): " + " | ".join(made[:3]), pytrace=False)


def real_tokenizer(name: str):
    """A real model family's tokenizer from ../shared/real-tokenizers (skips where that folder is absent)."""
    from transformers import AutoTokenizer

    folder = REAL_TOKENIZERS / name
    if not folder.is_dir():
        pytest.skip(
            f"{ABSENT}: {folder} is not there (the shared real-tokenizers folder beside the checkout; or set "
            "HF_SANITY_REAL_TOKENIZERS=<folder>)"
        )
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def conversations():
    from hf_sanity.testing import demo_conversations

    return demo_conversations(48)


@pytest.fixture(scope="session")
def chatml():
    from hf_sanity.testing import build_tokenizer

    return build_tokenizer("chatml", "distinct")


@pytest.fixture(scope="session")
def tiny_chatml():
    """(model, tokenizer) of the cached tiny ChatML setup."""
    from hf_sanity.testing import tiny_setup

    return tiny_setup("chatml", "distinct")


# -- the tiny LLaVA's processor, loaded once ------------------------------------------------------------
def processor_state(processor) -> dict:
    """What a trainer could change in a processor: its image processor and chat template, and its tokenizer's
    vocabulary, special tokens, sides, length and template. (Not the Rust tokenizer's padding and truncation:
    transformers sets them again at every call.)"""
    tok = processor.tokenizer
    return {
        "processor": processor.to_json_string(), "len": len(tok), "special": tok.special_tokens_map,
        "padding_side": tok.padding_side, "truncation_side": tok.truncation_side,
        "model_max_length": tok.model_max_length, "chat_template": tok.chat_template,
        "added_tokens": str(tok.added_tokens_decoder),
    }  # fmt: skip


@pytest.fixture(scope="session")
def llava_processor():
    from hf_sanity.testing import vlm

    return vlm.load_tiny_llava()[1]


@pytest.fixture
def shared_llava_processor(llava_processor, monkeypatch):
    """``vlm.load_tiny_llava()`` gives a fresh model (the tests train it) and the processor loaded once for the
    session (loading the real Qwen2.5 tokenizer took a third of each VLM test). A test that changes the shared
    processor fails, so none can leak into the next. (`pytest.mark.usefixtures("shared_llava_processor")`)"""
    from transformers import LlavaForConditionalGeneration

    from hf_sanity.testing import vlm

    def load_tiny_llava(seed: int = 0):
        return LlavaForConditionalGeneration.from_pretrained(vlm.tiny_llava_dir(seed)), llava_processor

    before = processor_state(llava_processor)
    monkeypatch.setattr(vlm, "load_tiny_llava", load_tiny_llava)
    yield
    after = processor_state(llava_processor)
    changed = {k: (v, after[k]) for k, v in before.items() if after[k] != v}
    assert not changed, f"the test changed the processor the session shares: {changed}"
