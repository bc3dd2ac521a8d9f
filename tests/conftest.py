"""Shared fixtures. Tests never touch the network: the Hub is switched off before anything imports it."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_SANITY_CACHE", os.path.join(os.path.dirname(__file__), "..", ".cache", "hf-sanity"))

from pathlib import Path

import pytest

REAL_TOKENIZERS = Path(__file__).resolve().parents[2] / "shared" / "real-tokenizers"


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
        pytest.skip(f"../shared/real-tokenizers/{name} is absent (it sits beside the checkout in CI)")
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
