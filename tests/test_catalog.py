import re
from pathlib import Path

import pytest

from hf_sanity import catalog
from hf_sanity.docs import render
from hf_sanity.errors import UserInputError

ROOT = Path(__file__).resolve().parents[1]


def test_every_rule_is_documented_once():
    rules = catalog.all_rules()
    assert len({r.slug for r in rules}) == len(rules)
    for rule in rules:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule.slug), rule.slug
        assert rule.severity in ("error", "warning", "info")
        assert rule.stage in catalog.STAGES
        for text in (rule.symptom, rule.detects, rule.fix):
            assert len(text) > 15, f"{rule.slug}: catalog text too thin: {text!r}"


def test_preflight_contract_slugs_exist():
    # Public contract from the preflight issue: these slugs must exist with these default severities
    # (pad-token-missing became a warning with the false-alarm issue: SFTTrainer sets a pad token itself).
    expected = {
        "bad-input-values": "error", "duplicate-examples": "warning", "split-leakage": "error",
        "label-leakage": "warning", "missing-chat-template": "error", "prompt-in-loss": "warning",
        "empty-loss-mask": "error", "completion-masked": "error", "labels-misaligned": "error",
        "eos-not-learned": "error", "pad-token-missing": "warning", "truncated-completion": "error",
        "max-len-exceeds-model": "error", "context-beyond-window": "warning",
    }  # fmt: skip
    rules = catalog.load()
    for slug, severity in expected.items():
        assert rules[slug].severity == severity, slug


def test_docs_page_is_generated_from_the_catalog():
    page = (ROOT / "docs" / "rules.md").read_text(encoding="utf-8")
    assert page == render(), "docs/rules.md is stale: run `make docs`"


def test_explain_is_the_catalog_text():
    rule = catalog.get("prompt-in-loss")
    text = rule.explain()
    assert "prompt-in-loss" in text and rule.fix in text and rule.symptom in text


def test_unknown_rule_is_a_user_error():
    with pytest.raises(UserInputError, match="unknown rule 'no-such-rule'"):
        catalog.get("no-such-rule")


def test_define_refuses_a_second_declaration():
    with pytest.raises(ValueError, match="declared twice"):
        catalog.define(
            "prompt-in-loss",
            severity="warning",
            stage="tokens",
            symptom="x" * 20,
            detects="y" * 20,
            fix="z" * 20,
        )
