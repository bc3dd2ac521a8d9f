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
