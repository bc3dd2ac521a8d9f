"""Every recipe runs end to end on the embedded tiny model with no arguments but a step budget."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REAL_TOKENIZERS

pytestmark = pytest.mark.slow  # subprocesses: `make test-fast` leaves them out

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize("recipe", ["sft_trl.py", "full_finetune.py"])
def test_recipe_runs(recipe, tmp_path):
    result = subprocess.run(
        [sys.executable, str(RECIPES / recipe), "--max-steps", "6", "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    # Every recipe ends with the output check of the trained model. Six steps on the embedded tiny model's
    # random weights teach no chat format, and the check says so (a model that never stops, or one that ends
    # its answer at once); its errors, and only those, make the recipe exit 1.
    said = json.loads((tmp_path / "out" / "hf-sanity" / "outputs.json").read_text())
    found = {f["rule"] for f in said["findings"]}
    assert found & {"never-stops", "answer-truncated", "identical-outputs"} and "internal-error" not in found
    assert said["stats"]["prompts"] > 0 and "hf-sanity outputs:" in result.stdout
    errors = any(f["severity"] == "error" for f in said["findings"])
    assert result.returncode == (1 if errors else 0), result.stdout[-4000:] + result.stderr[-4000:]
    assert "hf-sanity preflight: no findings" in result.stdout
    report = tmp_path / "out" / "hf-sanity" / "report.json"
    assert report.is_file(), "SanityCallback writes its report at train end"


def test_the_sft_trl_recipe_with_no_arguments_says_its_model_answers_every_prompt_alike(tmp_path):
    """`python recipes/sft_trl.py`: 60 LoRA steps on the random-weight tiny model teach it one cut-off sentence,
    `The capital of.`, for nearly every held-out prompt. Each answer stops, none loops or echoes: outputs said
    "no findings" and the recipe exited 0, while its docstring promised a finding and exit 1."""
    result = subprocess.run(
        [sys.executable, str(RECIPES / "sft_trl.py"), "--output-dir", str(tmp_path / "out")], capture_output=True,
        text=True, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"},
    )  # fmt: skip
    said = json.loads((tmp_path / "out" / "hf-sanity" / "outputs.json").read_text())
    (same,) = [f for f in said["findings"] if f["rule"] == "identical-outputs"]
    assert same["severity"] == "error" and same["evidence"]["share"] >= 0.8
    assert (
        same["evidence"]["answer"] in same["message"]
        and same["evidence"]["prompts"] == said["stats"]["prompts"]
    )
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-4000:]
    assert "identical-outputs" in result.stdout


def test_lora_recipe_with_no_arguments_trains_serves_and_passes(tmp_path):
    """The first command a new user runs: `python recipes/lora_sft.py`, nothing else. From a tiny chat model
    that already answers and stops, LoRA teaches a new answer style; every check passes and it exits 0, in
    well under a minute of CPU (the base model built and cached on first use included)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # One thread and a fixed hash seed: the same recipe run changed with the process's hash seed (answers in the
    # new style on 11 or 12 of 12; in 1 run of 7 an isolated late gradient spike: info, the clip bounded it).
    result = subprocess.run(
        [sys.executable, str(RECIPES / "lora_sft.py")], capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"},
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = tmp_path / "out" / "lora_sft"
    for said in ("hf-sanity serving check: no findings", "hf-sanity outputs: no findings"):
        assert said in result.stdout
    watched = json.loads((out / "hf-sanity" / "report.json").read_text())["findings"]
    assert [f["rule"] for f in watched if f["severity"] != "info"] == []  # the callback: a clean run
    outputs = json.loads((out / "hf-sanity" / "outputs.json").read_text())
    assert outputs["stats"]["stopped"] == outputs["stats"]["prompts"] > 0  # it answers, and stops
    assert (out / "merged" / "model.safetensors").is_file() and (out / "adapter").is_dir()
    assert cpu < 60, f"{cpu:.0f} s of CPU"
    # The adapter taught the style: the merged model, as served, opens its answers with "Sure."
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_sanity.testing import held_out_conversations

    model, tok = (
        AutoModelForCausalLM.from_pretrained(out / "merged"),
        AutoTokenizer.from_pretrained(out / "merged"),
    )
    opened = 0
    for row in held_out_conversations(12):
        prompt = tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, return_dict=True,
                                         return_tensors="pt")  # fmt: skip
        answer = model.generate(**prompt, max_new_tokens=24, do_sample=False)[
            0, prompt["input_ids"].shape[1] :
        ]
        opened += tok.decode(answer, skip_special_tokens=True).startswith("Sure.")
    # Most of them: the run is reproducible on one machine (below), but another CPU's arithmetic is another
    # draw: 11 of 12 on an AVX-512 Xeon; before the recipe seeded its LoRA weights, 8 to 12 run to run.
    assert opened >= 8, opened


@pytest.mark.parametrize("recipe", ["lora_sft.py", "sft_trl.py"])
def test_a_recipe_run_twice_trains_the_same_adapter(recipe, tmp_path):
    """The same command on the same machine gives the same adapter, bit for bit. `lora_sft.py` builds its LoRA
    before the Trainer seeds the run, and torch seeds each process differently: unseeded, two runs of it opened 8
    and 10 of 12 answers in the style it teaches. TRL 1.16 seeds before it builds the adapter (`sft_trl.py`), TRL
    0.24 after: the recipes seed first either way."""
    adapters = []
    for run in ("first", "second"):
        out = tmp_path / run
        result = subprocess.run(
            [sys.executable, str(RECIPES / recipe), "--max-steps", "3", "--output-dir", str(out)],
            capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert result.returncode in (0, 1), result.stdout[-4000:] + result.stderr[-4000:]
        (adapter,) = out.rglob("adapter_model.safetensors")
        adapters.append(adapter.read_bytes())
    assert adapters[0] == adapters[1]


def test_a_full_finetune_trained_long_enough_passes_the_output_check(tmp_path):
    """Trained long enough, the tiny model answers and stops: the recipe's last gate is green, and the callback
    ran the same checks at both evaluations."""
    result = subprocess.run(
        [sys.executable, str(RECIPES / "full_finetune.py"), "--max-steps", "250", "--batch-size", "32", "--lr",
         "3e-3", "--generate-every", "125", "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "hf-sanity outputs: no findings" in result.stdout
    report = json.loads((tmp_path / "out" / "hf-sanity" / "report.json").read_text())
    assert report["stats"]["generate"]["checks"] == 2
    assert [f["rule"] for f in report["findings"] if f["rule"] in OUTPUT_RULES] == []
    # A clean run that converges is silent throughout (predictions that settle are not frozen predictions).
    assert [f"{f['rule']}: {f['message']}" for f in report["findings"] if f["severity"] != "info"] == []


OUTPUT_RULES = {"never-stops", "stop-token-mismatch", "repeats-prompt", "stray-markers-in-output",
                "adapter-no-effect", "repetition-loop", "answer-truncated", "identical-outputs"}  # fmt: skip


@pytest.mark.clean("preference-pairs-identical", "preference-no-signal", "reference-mismatch", "policy-drift")
def test_the_dpo_recipe_runs_with_no_arguments_and_passes(tmp_path):
    """DPO after SFT on the embedded tiny model: preflight of the pairs, the callback on TRL's metrics, the
    output check against the same model with its adapter off: all silent, exit 0."""
    result = subprocess.run(
        [sys.executable, str(RECIPES / "dpo.py"), "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (
        "hf-sanity preflight: no findings" in result.stdout
        and "hf-sanity outputs: no findings" in result.stdout
    )
    report = json.loads((tmp_path / "out" / "hf-sanity" / "report.json").read_text())
    assert report["stats"]["objective"] == "preference" and report["findings"] == []
    said = json.loads((tmp_path / "out" / "hf-sanity" / "outputs.json").read_text())
    assert said["stats"]["objective"] == "preference" and said["stats"]["stopped"] == said["stats"]["prompts"]


def test_the_grpo_recipe_runs_clean_and_scores_its_held_out_prompts(tmp_path):
    """GRPO after SFT on the embedded tiny model: the preflight, the run and the output check are silent, and the
    reward functions are scored on the held-out answers against the last training steps' reward."""
    result = subprocess.run(
        [sys.executable, str(RECIPES / "grpo.py"), "--max-steps", "4", "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (
        "hf-sanity preflight: no findings" in result.stdout
        and "hf-sanity outputs: no findings" in result.stdout
    )
    said = json.loads((tmp_path / "out" / "hf-sanity" / "outputs.json").read_text())
    rewards = said["stats"]["rewards"]
    assert rewards["held_out"] is not None and rewards["train"] is not None and rewards["errors"] == {}
    assert said["stats"]["objective"] == "rl"
    report = json.loads((tmp_path / "out" / "hf-sanity" / "report.json").read_text())
    assert report["stats"]["objective"] == "rl" and report["findings"] == []


@pytest.mark.skipif(
    not (REAL_TOKENIZERS / "qwen2.5-instruct").is_dir(),
    reason="the tiny LLaVA needs ../shared/real-tokenizers/qwen2.5-instruct",
)
def test_the_vlm_recipe_runs_offline_with_no_arguments_and_ends_silent(tmp_path):
    """`python recipes/vlm_sft.py`: a tiny LLaVA built from its configs, prompt-completion VLM rows, preflight on
    the trainer's batches, a few SFTTrainer steps watched by the callback; nothing to report, exit 0."""
    result = subprocess.run(
        [sys.executable, str(RECIPES / "vlm_sft.py")], capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "hf-sanity preflight: no findings" in result.stdout
    assert "hf-sanity training: no findings" in result.stdout
    out = tmp_path / "out" / "vlm_sft"
    report = json.loads((out / "hf-sanity" / "report.json").read_text())
    assert report["stats"]["steps"] == 8  # the callback watched every step of the run
    assert [f["rule"] for f in report["findings"] if f["severity"] != "info"] == []
    # The model and its processor saved together: the folder loads back as one pipeline.
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(out / "final")
    assert processor.image_processor is not None and processor.chat_template
