"""`vision-tower-adapters`: a LoRA on a vision-language model whose layers land on the vision encoder or the
projector without the user naming them, through TRL's real SFTTrainer(peft_config=...) on the tiny LLaVA."""

from __future__ import annotations

import pytest
from peft import LoraConfig

from hf_sanity import preflight
from hf_sanity.testing import vlm
from tests.conftest import REAL_TOKENIZERS

pytestmark = [
    pytest.mark.skipif(
        not (REAL_TOKENIZERS / "qwen2.5-instruct").is_dir(),
        reason="needs ../shared/real-tokenizers/qwen2.5-instruct",
    ),
    pytest.mark.usefixtures("shared_llava_processor"),
]

RULE = "vision-tower-adapters"


def found(report):
    assert "internal-error" not in {f.rule for f in report.findings}
    return [f for f in report.findings if f.rule == RULE]


def lora_trainer(tmp_path, target_modules):
    return vlm.vlm_sft_trainer(
        tmp_path, vlm.vlm_prompt_completion(8), peft_config=LoraConfig(r=4, target_modules=target_modules)
    )


def adapted_paths(trainer) -> list[str]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, m in trainer.model.named_modules() if isinstance(m, BaseTunerLayer)]


@pytest.mark.planted("vision-tower-adapters")
@pytest.mark.parametrize(
    "target_modules, vision_layers",
    [
        ("all-linear", 6 + 2),
        pytest.param(["q_proj", "v_proj"], 2, marks=pytest.mark.slow),  # CLIP's attention has them too
    ],
)
def test_lora_targets_that_the_vision_tower_shares_put_adapters_on_it(
    tmp_path, target_modules, vision_layers
):
    trainer = lora_trainer(tmp_path, target_modules)
    (finding,) = found(preflight(trainer=trainer))
    assert finding.severity == "warning"
    evidence = finding.evidence
    assert evidence["cause"] == "untargeted"
    assert len(evidence["vision_layers"]) == vision_layers
    assert all(
        p.startswith(("model.vision_tower.", "model.multi_modal_projector."))
        for p in evidence["vision_layers"]
    )
    assert "model.vision_tower.encoder.layers.0.self_attn.q_proj" in evidence["vision_layers"]
    # The shares are the trainable parameters' own: the LoRA A/B of each tower, counted from the model.
    trainable = {n: p.numel() for n, p in trainer.model.named_parameters() if p.requires_grad}
    vision = sum(v for n, v in trainable.items() if ".vision_tower." in n or ".multi_modal_projector." in n)
    share = evidence["trainable_share"]
    assert share["vision encoder"] + share["projector"] == pytest.approx(
        vision / sum(trainable.values()), abs=1e-3
    )
    assert 0 < share["vision encoder"] < 1 and share["language model"] > 0
    assert evidence["language_model_path"] == "model.language_model"
    assert evidence["language_only_target"] in finding.fix


@pytest.mark.slow  # another VLM case; the fast lane runs the all-linear one
@pytest.mark.clean("vision-tower-adapters")
def test_the_fixs_regex_targets_the_language_model_alone(tmp_path):
    planted = found(preflight(trainer=lora_trainer(tmp_path / "planted", "all-linear")))[0]
    regex = planted.evidence["language_only_target"]
    trainer = lora_trainer(tmp_path / "fixed", regex)
    paths = adapted_paths(trainer)
    assert len(paths) == planted.evidence["adapted_layers"]["language model"] == 14
    assert all(".language_model." in p for p in paths)
    assert found(preflight(trainer=trainer)) == []


@pytest.mark.slow  # another VLM case; the fast lane runs the all-linear one
@pytest.mark.clean("vision-tower-adapters")
def test_a_projector_named_in_target_modules_is_meant(tmp_path):
    trainer = lora_trainer(tmp_path, r".*(multi_modal_projector\.linear_\d|language_model.*\.q_proj)")
    assert any(".multi_modal_projector." in p for p in adapted_paths(trainer))
    assert found(preflight(trainer=trainer)) == []


@pytest.mark.clean("vision-tower-adapters")
def test_a_text_model_with_lora_all_linear_is_silent(tmp_path):
    from hf_sanity.testing import tiny_setup
    from tests.moe_setups import sft_trainer

    model, tok = tiny_setup()
    trainer = sft_trainer(tmp_path, model, tok, peft_config=LoraConfig(r=4, target_modules="all-linear"))
    assert adapted_paths(trainer)
    report = preflight(trainer=trainer)
    assert report.stats["modality"] == "text"
    assert found(report) == []
