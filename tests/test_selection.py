import pytest

from hf_sanity.errors import UserInputError
from hf_sanity.findings import Finding
from hf_sanity.selection import Selection, find_config, resolve


def test_default_enables_everything():
    assert Selection.build().enabled("prompt-in-loss")


def test_select_and_ignore_by_slug_and_stage():
    sel = Selection.build(select=["tokens"], ignore="prompt-in-loss")
    assert sel.enabled("eos-not-learned")
    assert not sel.enabled("prompt-in-loss")
    assert not sel.enabled("duplicate-examples")  # stage data is not selected


def test_comma_separated_selectors():
    sel = Selection.build(select="prompt-in-loss,eos-not-learned")
    assert sel.enabled("eos-not-learned") and not sel.enabled("empty-loss-mask")


def test_internal_errors_cannot_be_silenced_by_select():
    assert Selection.build(select="prompt-in-loss").enabled("internal-error")


def test_unknown_selector_names_the_choices():
    with pytest.raises(UserInputError, match="unknown rule or stage 'prompt-in-los'"):
        Selection.build(select="prompt-in-los")


def test_pyproject_table_is_found_from_a_subfolder(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.hf-sanity]\nignore = ["duplicate-examples"]\nseverity = { "prompt-in-loss" = "error" }\n'
    )
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    table, path = find_config()
    assert path == tmp_path / "pyproject.toml" and table["ignore"] == ["duplicate-examples"]
    sel = resolve(ignore="label-leakage")
    assert not sel.enabled("duplicate-examples") and not sel.enabled("label-leakage")
    finding = Finding("prompt-in-loss", "warning", "37% of supervised tokens are prompt tokens")
    assert sel.apply(finding).severity == "error"
    assert resolve(use_config=False).enabled("duplicate-examples")


def test_bad_config_is_a_user_error(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[tool.hf-sanity]\nselect = ["nope"]\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserInputError, match=r"\[tool.hf-sanity\]"):
        resolve()
    (tmp_path / "pyproject.toml").write_text("[tool.hf-sanity\n")
    with pytest.raises(UserInputError, match="cannot read"):
        resolve()
