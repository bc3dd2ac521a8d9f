"""Every recipe runs end to end on the embedded tiny model with no arguments but a step budget."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses: `make test-fast` leaves them out

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize("recipe", ["lora_sft.py", "sft_trl.py", "full_finetune.py"])
def test_recipe_runs(recipe, tmp_path):
    result = subprocess.run(
        [sys.executable, str(RECIPES / recipe), "--max-steps", "6", "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "hf-sanity preflight: no findings" in result.stdout
    report = tmp_path / "out" / "hf-sanity" / "report.json"
    assert report.is_file(), "SanityCallback writes its report at train end"
    if recipe == "lora_sft.py":
        assert "hf-sanity serving check: no findings" in result.stdout
        assert (tmp_path / "out" / "merged" / "model.safetensors").is_file()
