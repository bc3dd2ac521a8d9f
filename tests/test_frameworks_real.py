"""LLaMA-Factory itself, with hf-sanity's entry point (`python -m hf_sanity.integrations.llamafactory cfg.yaml`, in
place of `llamafactory-cli train cfg.yaml`): a tiny Llama on the real Qwen2.5 tokenizer, LoRA SFT on ShareGPT
rows, a few steps on the CPU, offline.

LLaMA-Factory 0.9.5 pins its own versions (transformers <= 5.6, TRL <= 0.24, peft <= 0.18.1, datasets <= 4.0),
so it runs in its own virtualenv: HF_SANITY_LLAMAFACTORY_VENV (default /work/venvs/lf), built with
`python3 -m venv DIR && DIR/bin/pip install torch==2.13.0 && DIR/bin/pip install llamafactory==0.9.5`. Without it
these tests skip and say so.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("HF_SANITY_LLAMAFACTORY_VENV", "/work/venvs/lf"))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    if not (VENV / "bin" / "llamafactory-cli").is_file():
        pytest.skip(
            f"NOT RUN: no LLaMA-Factory virtualenv at {VENV} (set HF_SANITY_LLAMAFACTORY_VENV, or build it: python3 "
            f"-m venv {VENV} && {VENV}/bin/pip install torch==2.13.0 && {VENV}/bin/pip install llamafactory==0.9.5)"
        )
    from conftest import real_tokenizer
    from hf_sanity.testing import demo_conversations, tiny_model_for

    root = tmp_path_factory.mktemp("llamafactory")
    tok = real_tokenizer("qwen2.5-instruct")
    tiny_model_for(tok).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rows = demo_conversations(32, multi_turn_every=0)
    (root / "train.json").write_text(json.dumps([{"messages": r["messages"]} for r in rows]))
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
            "system_tag": "system"}  # fmt: skip
    info = {"demo": {"file_name": "train.json", "formatting": "sharegpt", "columns": {"messages": "messages"},
                     "tags": tags}}  # fmt: skip
    (root / "dataset_info.json").write_text(json.dumps(info))
    return root


def llamafactory_train(root: Path, name: str, **keys) -> dict:
    """LoRA SFT through hf-sanity's LLaMA-Factory entry point, as a user runs it; the report it wrote."""
    out = root / name
    config = {
        "model_name_or_path": str(root / "model"), "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "lora_target": "all", "dataset": "demo", "dataset_dir": str(root), "template": "qwen", "cutoff_len": 1024,
        "output_dir": str(out), "overwrite_output_dir": True, "per_device_train_batch_size": 2, "max_steps": 4,
        "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
        "preprocessing_num_workers": 1, "bf16": False, **keys,
    }  # fmt: skip
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "DISABLE_VERSION_CHECK": "1"}  # fmt: skip
    env.pop("VIRTUAL_ENV", None)
    result = subprocess.run([str(VENV / "bin" / "python"), "-m", "hf_sanity.integrations.llamafactory", str(path)],
                            capture_output=True, text=True, timeout=900, cwd=root, env=env)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "hf-sanity" / "report.json").read_text())


def by_rule(report: dict) -> dict[str, dict]:
    return {f["rule"]: f for f in report["findings"]}


@pytest.mark.clean("truncated-completion", "eos-not-learned", "prompt-in-loss", "template-mismatch")
def test_a_clean_llamafactory_lora_run_is_watched_and_silent(files):
    report = llamafactory_train(files, "clean")
    assert report["findings"] == []
    assert report["stats"]["steps"] == 4
    assert report["stats"]["trainer"] == {"class": "CustomSeq2SeqTrainer", "module": "llamafactory.train.sft.trainer",
                                          "framework": "LLaMA-Factory"}  # fmt: skip


@pytest.mark.planted("truncated-completion")
def test_a_cutoff_len_that_cuts_the_prompts_is_named_in_llamafactorys_terms(files):
    """cutoff_len 30: the answers are short, so LLaMA-Factory keeps them and cuts the prompts (the assistant
    header and the end of the question go): not an end-of-turn bug."""
    found = by_rule(llamafactory_train(files, "prompt-cut", cutoff_len=30))
    assert "eos-not-learned" not in found and "internal-error" not in found, found
    finding = found["truncated-completion"]
    evidence = finding["evidence"]
    assert evidence["cause"] == "trainer-max-length" and evidence["cut_read_from"] == "config"
    assert evidence["framework"] == "LLaMA-Factory" and evidence["setting"] == "cutoff_len"
    assert evidence["prompt_cut"] == 2 and evidence["cut_mid_answer"] == 0
    assert finding["message"].startswith("LLaMA-Factory's cutoff_len=30 cuts the prompt of 2")
    assert "`cutoff_len` in the LLaMA-Factory config" in finding["fix"]


@pytest.mark.planted("truncated-completion")
def test_a_cutoff_len_that_cuts_the_answers_is_truncation_not_a_masked_eos(files):
    found = by_rule(llamafactory_train(files, "answer-cut", cutoff_len=16))
    assert "eos-not-learned" not in found and "internal-error" not in found, found
    evidence = found["truncated-completion"]["evidence"]
    assert evidence["cause"] == "trainer-max-length" and evidence["cut_mid_answer"] == 2
    assert found["truncated-completion"]["severity"] == "error"


def test_run_dash_dash_on_llamafactory_cli_reads_the_cutoff_len_of_its_command_line(files):
    """`hf-sanity run -- llamafactory-cli train cfg.yaml cutoff_len=30`: the import hook attaches the callback to
    LLaMA-Factory's trainer and reads the cut from the config and the override the command line gives."""
    import sys

    config = {
        "model_name_or_path": str(files / "model"), "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "lora_target": "all", "dataset": "demo", "dataset_dir": str(files), "template": "qwen", "cutoff_len": 1024,
        "output_dir": str(files / "cli-out"), "overwrite_output_dir": True, "per_device_train_batch_size": 2,
        "max_steps": 2, "save_strategy": "no", "report_to": "none", "preprocessing_num_workers": 1, "bf16": False,
    }  # fmt: skip
    (files / "cli.yaml").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "DISABLE_VERSION_CHECK": "1"}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "hf_sanity.cli", "run", "--report", str(files / "cli-report"), "--",
         str(VENV / "bin" / "llamafactory-cli"), "train", str(files / "cli.yaml"), "cutoff_len=30"],
        capture_output=True, text=True, timeout=900, cwd=files, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "SanityCallback watched CustomSeq2SeqTrainer in 1 process" in " ".join(
        (result.stdout + result.stderr).split()
    )
    report = json.loads((files / "cli-report" / "hf-sanity" / "report.json").read_text())
    found = by_rule(report)
    assert "eos-not-learned" not in found and "internal-error" not in found, found
    evidence = found["truncated-completion"]["evidence"]
    assert evidence["max_len"] == 30 and evidence["cut_read_from"] == "config" and evidence["prompt_cut"] == 2


@pytest.mark.planted("template-mismatch")
def test_a_llama3_template_on_a_chatml_model_is_caught_at_the_first_step(files):
    """`template: llama3` with `resize_vocab: true` on the Qwen2.5 tokenizer: LLaMA-Factory trains on Llama-3's
    header markers split into text pieces, while the saved tokenizer keeps ChatML. Caught on the first batch, the
    fix in LLaMA-Factory's terms."""
    found = by_rule(llamafactory_train(files, "llama3", template="llama3", resize_vocab=True))
    assert "internal-error" not in found, found
    finding = found["template-mismatch"]
    assert finding["severity"] == "error" and finding["step"] == 1
    assert "llama-3 chat markers" in finding["message"] and "chatml" in finding["message"]
    assert "`template:` in the LLaMA-Factory config" in finding["fix"]


def test_without_resize_vocab_llamafactorys_own_crash_shows_its_own_traceback(files):
    """Without `resize_vocab`, LLaMA-Factory adds Llama-3's tokens to the tokenizer and not to the model: its
    first step raises on ids the embedding does not hold. Before that crash the report names the cause
    (`vocab-size-mismatch`, measured without a probe on ids the model cannot embed: no internal-error), and the
    crash's traceback is LLaMA-Factory's and torch's, without the callback's pass-through frames."""
    out = files / "no-resize"
    config = {
        "model_name_or_path": str(files / "model"), "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "lora_target": "all", "dataset": "demo", "dataset_dir": str(files), "template": "llama3", "cutoff_len": 1024,
        "output_dir": str(out), "overwrite_output_dir": True, "per_device_train_batch_size": 2, "max_steps": 4,
        "save_strategy": "no", "report_to": "none", "preprocessing_num_workers": 1, "bf16": False,
    }  # fmt: skip
    (files / "no-resize.yaml").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "DISABLE_VERSION_CHECK": "1"}  # fmt: skip
    env.pop("VIRTUAL_ENV", None)
    result = subprocess.run(
        [str(VENV / "bin" / "python"), "-m", "hf_sanity.integrations.llamafactory", str(files / "no-resize.yaml")],
        capture_output=True, text=True, timeout=900, cwd=files, env=env,
    )  # fmt: skip
    assert result.returncode != 0
    assert "\nIndexError: index out of range in self" in result.stderr
    frames = [line for line in result.stderr.splitlines() if line.lstrip().startswith('File "')]
    assert any("torch/nn/functional.py" in line for line in frames)
    assert not [line for line in frames if "hf_sanity/training/" in line], frames
    report = by_rule(json.loads((out / "hf-sanity" / "report.json").read_text()))
    assert "vocab-size-mismatch" in report and "internal-error" not in report, report
