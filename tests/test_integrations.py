"""The frameworks' native hooks: the Axolotl plugin (`plugins: [hf_sanity.integrations.axolotl.SanityPlugin]`)
and LLaMA-Factory's entry point (`run_exp(args, callbacks=[SanityCallback()])`).

The runs through the real framework need its own virtualenv at the versions it pins (Axolotl 0.19: transformers
5.16.1, TRL 1.9): HF_SANITY_AXOLOTL_VENV (default /work/venvs/ax), built with
`python3 -m venv DIR && DIR/bin/pip install torch==2.13.0 && DIR/bin/pip install axolotl==0.19.0`. Without it
they skip and say so."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist import tinytrain as tt

ROOT = Path(__file__).resolve().parents[1]
AXOLOTL_VENV = Path(os.environ.get("HF_SANITY_AXOLOTL_VENV", "/work/venvs/ax"))


def test_the_axolotl_plugin_imports_without_axolotl_and_attaches_one_callback(tmp_path):
    code = (
        "import sys; import hf_sanity.integrations.axolotl as m; "
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('axolotl', 'torch', 'transformers')))"
    )
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert (
        imported.stdout.strip() == "[]"
    )  # nothing heavy at import: Axolotl imports it while loading plugins
    from hf_sanity import SanityCallback
    from hf_sanity.integrations.axolotl import SanityPlugin

    trainer = tt.trainer(tmp_path / "out", max_steps=2)
    (added,) = SanityPlugin().add_callbacks_post_trainer({}, trainer)
    assert type(added) is SanityCallback
    trainer.add_callback(added)
    assert SanityPlugin().add_callbacks_post_trainer({}, trainer) == []  # never a second one
    trainer.train()
    assert added.report.stats["steps"] == 2 and (tmp_path / "out" / "hf-sanity" / "report.json").is_file()


def test_the_llamafactory_entry_point_reads_the_config_and_says_a_bad_one_in_one_line(tmp_path):
    from hf_sanity.integrations.llamafactory import main, read_config

    config = tmp_path / "train.yaml"
    config.write_text("model_name_or_path: m\nstage: sft\ncutoff_len: 40\n")
    assert read_config(config) == {"model_name_or_path": "m", "stage": "sft", "cutoff_len": 40}
    result = subprocess.run([sys.executable, "-m", "hf_sanity.integrations.llamafactory", tmp_path / "none.yaml"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: no LLaMA-Factory config at {tmp_path / 'none.yaml'}"
    ]
    assert main([]) == 2
    if importlib.util.find_spec("llamafactory") is None:  # a good config, and no LLaMA-Factory: said so
        result = subprocess.run([sys.executable, "-m", "hf_sanity.integrations.llamafactory", config],
                                capture_output=True, text=True, timeout=120, cwd=tmp_path,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [
            "error: LLaMA-Factory is not installed here (pip install llamafactory)"
        ]


# -- through the real Axolotl -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def axolotl_files(tmp_path_factory):
    if not (AXOLOTL_VENV / "bin" / "axolotl").is_file():
        pytest.skip(
            f"NOT RUN: no Axolotl virtualenv at {AXOLOTL_VENV} (set HF_SANITY_AXOLOTL_VENV, or build it: python3 -m "
            f"venv {AXOLOTL_VENV} && {AXOLOTL_VENV}/bin/pip install torch==2.13.0 && {AXOLOTL_VENV}/bin/pip "
            "install axolotl==0.19.0)"
        )
    from conftest import real_tokenizer
    from hf_sanity.testing import demo_conversations, tiny_model_for

    root = tmp_path_factory.mktemp("axolotl")
    tok = real_tokenizer("qwen2.5-instruct")
    tiny_model_for(tok).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rows = demo_conversations(32, multi_turn_every=0)
    (root / "train.jsonl").write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    return root


def axolotl_train(root: Path, out: Path, **keys) -> tuple[subprocess.CompletedProcess, dict]:
    """`axolotl train config.yml` with the plugin listed, as a user runs it (its own virtualenv, offline)."""
    config = {
        "base_model": str(root / "model"), "chat_template": "tokenizer_default",
        "datasets": [{"path": str(root / "train.jsonl"), "ds_type": "json", "type": "chat_template",
                      "field_messages": "messages"}],
        "sequence_len": 256, "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 4,
        "num_epochs": 1, "learning_rate": 0.001, "optimizer": "adamw_torch", "lr_scheduler": "constant",
        "output_dir": str(out), "dataset_prepared_path": str(out.parent / f"{out.name}-prepared"),
        "save_strategy": "no", "logging_steps": 1, "bf16": False, "fp16": False, "tf32": False,
        "plugins": ["hf_sanity.integrations.axolotl.SanityPlugin"], **keys,
    }  # fmt: skip
    path = out.parent / f"{out.name}.yml"
    path.write_text(json.dumps(config))  # JSON is YAML
    env = {**os.environ, "PATH": f"{AXOLOTL_VENV / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "AXOLOTL_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    env.pop("VIRTUAL_ENV", None)
    result = subprocess.run([str(AXOLOTL_VENV / "bin" / "axolotl"), "train", str(path)], capture_output=True,
                            text=True, timeout=900, cwd=out.parent, env=env)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        "Plugin loaded successfully: hf_sanity.integrations.axolotl.SanityPlugin"
        in result.stdout + result.stderr
    )
    return result, json.loads((out / "hf-sanity" / "report.json").read_text())


@pytest.mark.slow
def test_a_clean_axolotl_run_with_the_plugin_is_watched_and_silent(axolotl_files):
    _, report = axolotl_train(axolotl_files, axolotl_files / "clean")
    assert report["findings"] == []
    assert report["stats"]["steps"] == 4  # the callback watched every step of Axolotl's trainer


@pytest.mark.slow
def test_an_axolotl_learning_rate_far_too_high_is_caught(axolotl_files):
    _, report = axolotl_train(axolotl_files, axolotl_files / "lr", learning_rate=3.0, max_steps=8)
    rules = {f["rule"] for f in report["findings"]}
    assert "loss-diverged" in rules and "internal-error" not in rules, report["findings"]


@pytest.mark.slow
@pytest.mark.planted("truncated-completion")
def test_an_axolotl_sequence_len_that_truncates_the_answers_is_named_in_axolotls_terms(axolotl_files):
    """`sequence_len: 40` with `excess_length_strategy: truncate`: the rows arrive cut at 40, their answers without
    an end of turn: truncation in Axolotl's terms, not an end-of-turn masking bug."""
    _, report = axolotl_train(
        axolotl_files, axolotl_files / "cut", sequence_len=40, excess_length_strategy="truncate"
    )
    found = {f["rule"]: f for f in report["findings"]}
    assert "eos-not-learned" not in found and "internal-error" not in found, report["findings"]
    finding = found["truncated-completion"]
    assert (
        finding["evidence"]["cause"] == "trainer-max-length" and finding["evidence"]["framework"] == "Axolotl"
    )
    assert (
        finding["evidence"]["setting"] == "sequence_len"
        and finding["evidence"]["cut_read_from"] == "arguments"
    )
    assert finding["message"].startswith("Axolotl's sequence_len=40 ")
    assert "`sequence_len` in the Axolotl config" in finding["fix"]
    assert report["stats"]["trainer"]["framework"] == "Axolotl"
