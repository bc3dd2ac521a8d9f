"""`config-not-applied`: config fields set on a model already built, which its modules never read."""

from __future__ import annotations

import warnings

import pytest
import torch
from moe_setups import load as load_moe
from moe_setups import (
    one_thread,  # noqa: F401 - autouse
    plain_trainer,
    sft_trainer,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_sanity.drivers.preflight import preflight
from hf_sanity.testing import demo_conversations, tiny_model_dir

SLUG = "config-not-applied"


LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}


def load(**kwargs):
    folder = tiny_model_dir("chatml", "distinct")
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs), AutoTokenizer.from_pretrained(folder)


def check(model, tok):
    report = preflight(
        model=model, tokenizer=tok, dataset=demo_conversations(8), select=[SLUG], use_config=False
    )
    return report.by_rule(SLUG)


def logits(model):
    ids = torch.arange(5, 300).unsqueeze(0)
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.planted("config-not-applied")
def test_rope_scaling_set_on_a_loaded_model_changes_nothing_it_computes():
    model, tok = load()
    before = logits(model)
    model.config.rope_parameters = dict(LINEAR)  # "context extended 4x"
    assert torch.equal(before, logits(model))  # the plant: byte-identical logits
    (finding,) = check(model, tok)
    assert finding.severity == "error" and finding.evidence["cause"] == "rope"
    (module,) = finding.evidence["modules"]
    assert module["module"] == "model.rotary_emb"
    assert module["rope_type"] == {"built": "default", "declared": "linear"}
    assert module["inv_freq"]["built"][1] == pytest.approx(4 * module["inv_freq"]["declared"][1], rel=1e-4)
    assert module["declared"] == LINEAR


@pytest.mark.planted("config-not-applied")
def test_a_new_rope_theta_on_a_loaded_model_is_not_applied():
    model, tok = load()
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
    (finding,) = check(model, tok)
    assert "inv_freq" in finding.evidence["modules"][0] and "rope_type" not in finding.evidence["modules"][0]


@pytest.mark.planted("config-not-applied")
def test_the_deprecated_rope_scaling_setter_leaves_a_config_that_does_not_load(tmp_path):
    model, tok = load()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.config.rope_scaling = {"type": "linear", "factor": 2.0}  # transformers 4 style: no rope_theta
    (finding,) = check(model, tok)
    assert finding.evidence["cause"] == "rope"
    said = finding.evidence["modules"][0]["rebuild_error"]
    model.save_pretrained(tmp_path)
    # What the finding says: the config does not rebuild (transformers 5.25: a TypeError; 5.16: KeyError
    # 'rope_type'), and from 5.25 on the saved model does not load, with the error it names (5.16 converts the
    # legacy key when it loads from disk: the model trained is still not the one the config describes).
    import transformers
    from packaging.version import Version

    assert said.startswith(("TypeError:", "KeyError:")), said
    if Version(transformers.__version__) >= Version("5.25"):
        with pytest.raises(TypeError) as raised:
            AutoModelForCausalLM.from_pretrained(tmp_path)
        assert said.startswith(f"{type(raised.value).__name__}:"), (said, raised.value)


@pytest.mark.planted("config-not-applied")
def test_attn_implementation_set_as_a_config_attribute_is_not_what_runs():
    model, tok = load()
    model.config.attn_implementation = "eager"
    (finding,) = check(model, tok)
    assert finding.severity == "warning" and finding.evidence["cause"] == "attn-implementation"
    assert finding.evidence["declared"] == "eager" and finding.evidence["effective"] == "sdpa"


@pytest.mark.planted("config-not-applied")
def test_a_router_coefficient_set_on_a_built_moe_config_is_not_the_one_its_loss_uses(tmp_path):
    model, tok = load_moe(output_router_logits=True)
    model.config.router_aux_loss_coef = 0.02
    report = preflight(trainer=plain_trainer(tmp_path, model, tok), select=[SLUG], use_config=False)
    (finding,) = report.by_rule(SLUG)
    assert finding.evidence == {"declared": 0.02, "built": 0.001, "cause": "router-aux-loss-coef"}


@pytest.mark.planted("config-not-applied")
def test_rope_scaling_set_before_a_trainer_is_built_is_found_through_the_trainer(tmp_path):
    from dist import tinytrain as tt

    model, tok = load()
    model.config.rope_parameters = dict(LINEAR)
    report = preflight(trainer=tt.trainer(tmp_path, model=model, tok=tok), select=[SLUG], use_config=False)
    assert [f.evidence["cause"] for f in report.by_rule(SLUG)] == ["rope"]


@pytest.mark.clean("config-not-applied")
@pytest.mark.parametrize(
    "rope",
    [
        LINEAR,
        {"rope_type": "default", "rope_theta": 1_000_000.0},
        {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 128},
    ],
    ids=lambda r: r["rope_type"],
)
def test_a_model_built_with_its_rope_parameters_is_silent(rope):
    model, tok = load(rope_parameters=dict(rope))
    logits(model)  # past the original length: a dynamic RoPE recomputes its frequencies, as it should
    assert check(model, tok) == []
    from hf_sanity.measure.config_applied import _rebuildable

    assert _rebuildable(model.model.rotary_emb)  # it was compared, not skipped


@pytest.mark.clean("config-not-applied")
def test_a_bf16_model_and_a_chosen_attention_implementation_are_silent():
    model, tok = load(attn_implementation="eager", dtype=torch.bfloat16)
    assert check(model, tok) == []


@pytest.mark.clean("config-not-applied")
def test_a_moe_under_sft_trainer_which_sets_the_coefficient_itself_is_silent(tmp_path):
    from trl import SFTConfig
    from trl_setups import skip_without_config_field

    skip_without_config_field(
        SFTConfig, "router_aux_loss_coef", "SFTTrainer writes its own coefficient into the MoE's config"
    )
    model, tok = load_moe()
    trainer = sft_trainer(tmp_path, model, tok, router_aux_loss_coef=0.01)
    assert (
        model.config.router_aux_loss_coef == 0.01 and model.router_aux_loss_coef == 0.001
    )  # TRL's own weighing
    report = preflight(trainer=trainer, select=[SLUG], use_config=False)
    assert report.by_rule(SLUG) == []
