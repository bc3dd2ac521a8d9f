"""The version contract: the supported ranges declared in pyproject, checked once where a report learns the
run's objective (one note per library outside its range), and TRL's internal tallies read only where they are
there and shaped as a supported TRL keeps them."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import tomllib
import trl_setups as setups
from packaging.requirements import Requirement

import hf_sanity
from hf_sanity import SanityCallback, versions
from hf_sanity.measure.objective import of_trainer
from hf_sanity.measure.rl import rollout_summary
from hf_sanity.testing import build_tokenizer, demo_preference_pairs, synthetic_conversations
from hf_sanity.training.trl_metrics import ObjectiveFeed

ROOT = Path(__file__).resolve().parent.parent
DECLARED = ["transformers<6,>=5.6", "datasets<6,>=4.0", "peft<1,>=0.18.1", "accelerate<2,>=1.11",
            'trl<2,>=0.24; extra == "trl"', 'pytest>=8; extra == "dev"']  # fmt: skip
NEWEST = {
    "transformers": "5.25.0",
    "trl": "1.16.0",
    "peft": "0.21.2",
    "datasets": "5.2.0",
    "accelerate": "1.16.0",
}


@pytest.fixture(autouse=True)
def _checked_afresh():
    """Each test reads the versions it sets up (the check is cached once per process)."""
    versions.declared.cache_clear()
    versions.outside.cache_clear()
    yield
    versions.declared.cache_clear()
    versions.outside.cache_clear()


def installed_as(monkeypatch, requires: list[str] | None, **installed: str | None) -> None:
    """hf-sanity's metadata declaring ``requires`` (None: hf-sanity not installed), and these libraries at these
    versions (None: not installed)."""
    real_requires, real_version = metadata.requires, metadata.version

    def fake_requires(name):
        if name != versions.DISTRIBUTION:
            return real_requires(name)
        if requires is None:
            raise metadata.PackageNotFoundError(name)
        return requires

    def fake_version(name):
        if name not in installed:
            return real_version(name)
        if installed[name] is None:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(metadata, "requires", fake_requires)
    monkeypatch.setattr(metadata, "version", fake_version)


def test_pyproject_declares_a_range_for_every_library_checked():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + project["optional-dependencies"]["trl"]
    ranges = {Requirement(line).name: Requirement(line).specifier for line in lines}
    for name in versions.AT_RISK:
        assert ranges.get(name) and any(s.operator == ">=" for s in ranges[name]), (name, ranges.get(name))
        assert any(s.operator == "<" for s in ranges[name]), (name, ranges[name])
    assert (
        "hf-sanity[trl]" in project["optional-dependencies"]["dev"]
    )  # the dev install tests a supported TRL


def test_requirement_lines_are_read_as_packaging_reads_them():
    """hf-sanity reads its declared ranges without packaging.requirements (~20 ms to import in every process that
    trains): the same name and specifier as packaging's parser, on the installed metadata and on the other
    shapes a line can take (extras, markers, parentheses, arbitrary equality, URLs)."""
    from packaging.utils import canonicalize_name

    lines = (metadata.requires(versions.DISTRIBUTION) or []) + DECLARED + [
        'Foo_Bar.baz[x,y] (>=1.0,<2)', "b", 'c>=1 ; python_version<"3.11"', "D-E~=1.4", "e===1.0", "f!=1.*,>0",
    ]  # fmt: skip
    for line in lines:
        theirs = Requirement(line)
        assert versions.requirement(line) == (canonicalize_name(theirs.name), str(theirs.specifier)), line
    assert versions.requirement("a @ https://example.com/a.whl") is None  # no range: not checked, as before


def test_a_library_outside_its_range_is_one_line_naming_its_version(monkeypatch):
    installed_as(monkeypatch, DECLARED, **{**NEWEST, "trl": "0.19.1", "transformers": "6.0.0"})
    lines = versions.check()
    assert len(lines) == 2, lines
    trl_line = next(line for line in lines if line.startswith("trl "))
    assert "trl 0.19.1 is outside" in trl_line and "trl<2,>=0.24" in trl_line and "_metrics" in trl_line
    assert any(line.startswith("transformers 6.0.0 is outside") for line in lines)
    assert not versions.supported("trl") and versions.supported("peft")


def test_the_newest_and_the_lower_lanes_versions_are_inside(monkeypatch):
    lower = {
        "transformers": "5.6.2",
        "trl": "0.24.0",
        "peft": "0.18.1",
        "datasets": "4.0.0",
        "accelerate": "1.11.0",
    }
    for lane in (NEWEST, lower):
        versions.outside.cache_clear()
        installed_as(monkeypatch, DECLARED, **lane)
        assert versions.check() == [], lane


def test_nothing_is_said_of_a_library_not_installed_or_of_a_source_tree(monkeypatch):
    installed_as(monkeypatch, DECLARED, **{**NEWEST, "trl": None})
    assert versions.check() == [] and versions.supported("trl")
    versions.declared.cache_clear()
    versions.outside.cache_clear()
    installed_as(monkeypatch, None, **NEWEST)  # hf-sanity run from a checkout that is not installed
    assert versions.check() == []


def test_preflight_says_it_once_in_its_report(monkeypatch):
    installed_as(monkeypatch, DECLARED, **{**NEWEST, "datasets": "3.6.0"})
    data = datasets.Dataset.from_list(synthetic_conversations(8))
    report = hf_sanity.preflight(
        tokenizer=build_tokenizer("chatml"), dataset=data, max_len=64, use_config=False
    )
    said = [note for note in report.notes if "is outside the versions hf-sanity supports" in note]
    assert said == [f"datasets 3.6.0 is outside the versions hf-sanity supports (datasets<6,>=4.0): "
                    f"{versions.AT_RISK['datasets']}"]  # fmt: skip


def test_importing_hf_sanity_checks_nothing():
    code = "import sys, hf_sanity; assert 'hf_sanity.versions' not in sys.modules and 'packaging' not in sys.modules"
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_dpo_run_under_an_unsupported_trl_reads_only_what_trl_logs(tmp_path, monkeypatch):
    """The run goes on, silent: the note names TRL's version, and the step-0 tallies are not read."""
    installed_as(monkeypatch, DECLARED, **{**NEWEST, "trl": "0.19.1"})
    cb = SanityCallback(use_config=False, print_findings=False, check_every=1)
    setups.dpo(tmp_path, demo_preference_pairs(8, seed=0), callbacks=[cb], max_steps=2).train()
    assert any(note.startswith("trl 0.19.1 is outside") for note in cb.report.notes), cb.report.notes
    assert cb.trl.active and not cb.trl.internals
    assert [f"{f.rule}: {f.message}" for f in cb.report.findings if f.severity != "info"] == []


def test_trls_tallies_absent_or_shaped_otherwise_are_read_as_nothing(tmp_path):
    """A TRL that keeps no ``_metrics``, or keeps them otherwise, gives no step-0 values (not an internal-error);
    the rollout summary of a trainer whose ``_logs`` lack per-function rewards is empty."""
    trainer = setups.dpo(tmp_path, demo_preference_pairs(4, seed=0))
    feed = ObjectiveFeed(trainer, SimpleNamespace(objective=of_trainer(trainer)))
    assert feed.internals
    trainer._metrics = {"train": {"rewards/chosen": [0.5]}}
    assert feed.first_step() == {"step0_metrics": {"rewards/chosen": 0.5}}  # as TRL keeps them: read
    for other in ({"train": [0.5]}, ["train"], {"train": {"rewards/chosen": 0.5}}):
        trainer._metrics = other
        assert feed.first_step() == {}, other
    del trainer._metrics
    assert feed.first_step() == {}
    rl_trainer = SimpleNamespace(
        num_generations=2,
        reward_funcs=[setups.length_reward],
        reward_weights=None,
        _logs={"rewards": {"length_reward": [1.0, 0.0]}, "completion": ["a", "b"]},
    )
    assert rollout_summary(rl_trainer)["groups"] == 1  # as TRL keeps them: read
    rl_trainer._logs = {"rewards": [1.0, 0.0], "completion": ["a", "b"]}
    assert rollout_summary(rl_trainer) == {}
