"""Template parity rules."""

import pytest
import trl_setups as setups

from conftest import real_tokenizer
from helpers import run, slugs
from hf_sanity.testing import as_prompt_completion, build_tokenizer

TEMPLATE_RULES = ["template-mismatch", "generation-prompt-mismatch", "stray-template-markers", "double-bos"]


@pytest.mark.parametrize("template", ["chatml", "llama3", "generation"])
@pytest.mark.clean("template")
def test_clean_templates_are_silent(template, conversations):
    tok = build_tokenizer(template)
    assert run(tok, conversations, select=TEMPLATE_RULES).findings == []
    assert (
        run(tok, as_prompt_completion(conversations, conversational=True), select=TEMPLATE_RULES).findings
        == []
    )


def test_plain_prose_is_not_a_template_mismatch(chatml):
    rows = [{"text": "The river ran quietly past the old mill. " * 3} for _ in range(5)]
    assert run(chatml, rows, select=TEMPLATE_RULES).findings == []


@pytest.mark.planted("template-mismatch")
def test_text_rendered_with_another_template(chatml, conversations):
    alpaca = [
        {
            "text": f"### Instruction:\n{r['messages'][-2]['content']}\n\n### Response:\n{r['messages'][-1]['content']}"
        }
        for r in conversations
    ]
    (finding,) = run(chatml, alpaca, select="template-mismatch").findings
    assert finding.evidence["foreign_formats"] == {"alpaca": len(conversations)}
    assert finding.evidence["template_formats"] == ["chatml"]
    # Text rendered with the tokenizer's own template is consistent.
    own = [{"text": chatml.apply_chat_template(r["messages"], tokenize=False)} for r in conversations]
    assert "template-mismatch" not in slugs(run(chatml, own, select="template-mismatch"))


def test_pretokenized_with_another_template(chatml, conversations):
    llama = build_tokenizer("llama3")
    rows = [{"input_ids": llama.apply_chat_template(r["messages"])["input_ids"]} for r in conversations]
    (finding,) = run(chatml, rows, select="template-mismatch").findings
    assert "llama-3" in finding.evidence["foreign_formats"]


def test_inference_tokenizer_with_another_template(chatml, conversations):
    report = run(
        chatml, conversations, select="template-mismatch", inference_tokenizer=build_tokenizer("llama3")
    )
    (finding,) = report.findings
    assert finding.evidence["mismatched"] == finding.evidence["checked"] == len(conversations)
    assert finding.evidence["first_difference"] == 0
    same = run(
        chatml, conversations, select="template-mismatch", inference_tokenizer=build_tokenizer("chatml")
    )
    assert same.findings == []


@pytest.mark.planted("generation-prompt-mismatch")
def test_generation_prompt_not_a_prefix(conversations):
    tok = build_tokenizer("chatml")
    # Inference opens a reasoning block that no training turn contains (as DeepSeek-R1's template does).
    tok.chat_template = tok.chat_template.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"
    )
    (finding,) = run(tok, conversations, select="generation-prompt-mismatch").findings
    assert finding.evidence["rows"][:3] == [0, 1, 2]
    assert finding.evidence["inference_prompt_ends"].endswith("assistant\n<think>\n")


def test_deepseek_r1_generation_prompt_opens_think():
    tok = real_tokenizer("deepseek-r1-distill")
    rows = [
        {
            "messages": [
                {"role": "user", "content": "What is 2 plus 3?"},
                {"role": "assistant", "content": "5"},
            ]
        }
    ]
    (finding,) = run(tok, rows, select="generation-prompt-mismatch").findings
    assert "<think>" in finding.evidence["inference_prompt_ends"]


@pytest.mark.planted("stray-template-markers")
def test_stray_markers_in_content(chatml, conversations):
    rows = [dict(r) for r in conversations[:10]]
    rows[6] = {"messages": [{"role": "user", "content": "Summarise: [INST] hi [/INST]"},
                            {"role": "assistant", "content": "Done.<|im_end|> more"}]}  # fmt: skip
    (finding,) = run(chatml, rows, select="stray-template-markers").findings
    assert finding.evidence["rows"] == [6]
    assert set(finding.evidence["markers"]) == {"[INST]", "[/INST]", "<|im_end|>"}


@pytest.mark.planted("double-bos")
def test_double_bos_from_retokenized_llama3_text(conversations):
    tok = build_tokenizer("llama3")
    rows = [{"text": tok.apply_chat_template(r["messages"], tokenize=False)} for r in conversations]
    (finding,) = run(tok, rows, select="double-bos").findings
    assert finding.evidence["count"] == len(conversations)
    assert run(tok, conversations, select="double-bos").findings == []


@pytest.mark.parametrize("name", ["llama3-instruct", "mistral-instruct", "llama2-chat"])
def test_double_bos_on_real_templates(name):
    tok = real_tokenizer(name)
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    ]
    text_rows = [{"text": tok.apply_chat_template(rows[0]["messages"], tokenize=False)}]
    assert "double-bos" in slugs(run(tok, text_rows, select="double-bos"))
    assert run(tok, rows, select="double-bos").findings == []


@pytest.mark.planted("stop-token-mismatch", "markers-not-atomic")
def test_a_chatml_template_on_a_llama3_tokenizer(conversations):
    """The turns end with '<|im_end|>' pieces the generation config never stops on, and the markers are not
    tokens of this tokenizer: training looks right, inference never stops."""
    from hf_sanity.testing import TinyConfig, tiny_model_for

    llama = real_tokenizer("llama3-instruct")
    model = tiny_model_for(llama, TinyConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    llama.chat_template = build_tokenizer("chatml").chat_template
    report = run(llama, conversations[:8], model=model, select=["stop-token-mismatch", "markers-not-atomic"])
    stop = report.by_rule("stop-token-mismatch")[0]
    assert stop.evidence["stop_tokens"] == ["<|eot_id|>"] and "<|im_end|>" in stop.evidence["end_of_turn"]
    pieces = report.by_rule("markers-not-atomic")[0].evidence["markers"]
    assert set(pieces) == {"<|im_start|>", "<|im_end|>"} and len(pieces["<|im_end|>"]) > 1


def test_a_generation_config_that_does_not_stop_on_the_end_of_turn(conversations):
    """A Llama-3 instruct template on the base model's tokenizer and generation config (EOS <|end_of_text|>)."""
    from hf_sanity.testing import TinyConfig, tiny_model_for

    llama = real_tokenizer("llama3-instruct")
    model = tiny_model_for(llama, TinyConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    llama.eos_token = "<|end_of_text|>"  # the base checkpoint's EOS
    model.generation_config.eos_token_id = llama.convert_tokens_to_ids("<|end_of_text|>")
    (finding,) = run(llama, conversations[:8], model=model, select="stop-token-mismatch").findings
    assert finding.evidence["end_of_turn_id"] == llama.convert_tokens_to_ids("<|eot_id|>")
    assert "128009" in finding.fix  # the id to add, for this tokenizer
    model.generation_config.eos_token_id = [128001, 128009]  # what the instruct checkpoint ships
    assert run(llama, conversations[:8], model=model, select="stop-token-mismatch").findings == []


SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
)


def llama3_served_as_base():
    """Llama-3's instruct tokenizer (EOS <|eot_id|>, as shipped) on a tiny model whose generation config stops on
    <|end_of_text|> only (the base checkpoint's): (model, tokenizer, <|eot_id|>, <|end_of_text|>)."""
    from hf_sanity.testing import TinyConfig, tiny_model_for

    llama = real_tokenizer("llama3-instruct")
    model = tiny_model_for(llama, TinyConfig(**SMALL))
    eot, end_of_text = llama.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert llama.eos_token_id == eot
    model.generation_config.eos_token_id = end_of_text
    return model, llama, eot, end_of_text


def forced_end_of_turn(model, tok, messages, eot: int) -> list[int]:
    """What ``model.generate`` writes after the prompt with <|eot_id|> forced at every step (8 tokens at most)."""
    prompt = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False, sequence_bias={(eot,): 100.0},
                         pad_token_id=tok.convert_tokens_to_ids("<|finetune_right_pad_id|>"))  # fmt: skip
    return out[0, prompt["input_ids"].shape[1] :].tolist()


@pytest.mark.planted("stop-token-mismatch")
def test_the_tokenizers_eos_is_no_stop_id_unless_the_generation_config_names_it(conversations):
    """The stop ids are what generate stops on: the generation config's eos_token_id. The premise, with the real
    generate: <|eot_id|> forced at every step, it writes 8 of 8 tokens; with both ids it stops at the first."""
    model, llama, eot, end_of_text = llama3_served_as_base()
    prompt = conversations[0]["messages"][:-1]
    assert forced_end_of_turn(model, llama, prompt, eot) == [eot] * 8
    (finding,) = run(llama, conversations[:8], model=model, select="stop-token-mismatch").findings
    assert (finding.evidence["end_of_turn_id"], finding.evidence["stop_ids"]) == (eot, [end_of_text])
    assert finding.evidence["stop_tokens"] == ["<|end_of_text|>"] and f"[{end_of_text}, {eot}]" in finding.fix
    model.generation_config.eos_token_id = [end_of_text, eot]  # as the instruct checkpoint ships it
    assert forced_end_of_turn(model, llama, prompt, eot) == [eot]
    assert run(llama, conversations[:8], model=model, select="stop-token-mismatch").findings == []


@pytest.mark.slow
@pytest.mark.planted("stop-token-mismatch")
@pytest.mark.clean("stop-token-mismatch")
def test_the_cli_reads_the_stop_ids_from_the_folders_generation_config(conversations, tmp_path):
    import json

    from helpers import cli

    model, llama, eot, end_of_text = llama3_served_as_base()
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in conversations[:8]))
    for name, stops, code in (("base", end_of_text, 1), ("instruct", [end_of_text, eot], 0)):
        folder = tmp_path / name
        model.generation_config.eos_token_id = stops
        model.save_pretrained(folder)
        llama.save_pretrained(folder)
        out = tmp_path / f"{name}.json"
        result = cli("preflight", "--model", folder, "--dataset", data, "--select", "stop-token-mismatch",
                     "--json", out)  # fmt: skip
        assert result.returncode == code, result.stdout + result.stderr
        findings = json.loads(out.read_text())["findings"]
        assert [(f["rule"], f["evidence"]["stop_ids"]) for f in findings] == (
            [("stop-token-mismatch", [end_of_text])] if code else []
        )


@pytest.mark.parametrize("name", ["tinyllama-chat", "phi3-instruct", "qwen2.5-instruct", "llama3-instruct"])
@pytest.mark.clean("stop-token-mismatch", "markers-not-atomic")
def test_native_templates_stop_and_their_markers_are_what_the_family_trained_on(name, conversations):
    from hf_sanity.testing import TinyConfig, tiny_model_for

    tok = real_tokenizer(name)
    model = tiny_model_for(tok, TinyConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    assert (
        run(
            tok, conversations[:8], model=model, select=["stop-token-mismatch", "markers-not-atomic"]
        ).findings
        == []
    )


@pytest.mark.planted("template-drops-content")
def test_deepseek_r1_template_drops_the_reasoning_it_is_trained_on():
    """DeepSeek-R1's template keeps only what follows ``</think>``: the data teaches reasoning, the model is
    trained on answers alone. TRL's training twin keeps the reasoning, and is clean."""
    from hf_sanity.testing import reasoning_conversations

    tok = real_tokenizer("deepseek-r1-distill")
    rows = reasoning_conversations(8)
    (finding,) = run(tok, rows, select="template-drops-content").findings
    assert finding.severity == "error" and finding.evidence["examples"] == 8
    assert finding.evidence["first_dropped"].startswith("<think>") and 0.3 < finding.evidence["fraction"] < 1
    assert "training variant" in finding.fix
    tok.chat_template = setups.trl_template("deepseek_r1_distill_training")
    assert run(tok, rows, select="template-drops-content").findings == []


@pytest.mark.planted("template-drops-content")
def test_a_template_without_tool_support_drops_the_calls():
    from hf_sanity.testing import tool_conversations

    tok = real_tokenizer("tinyllama-chat")  # its template renders `content` only
    (finding,) = run(tok, tool_conversations(8), select="template-drops-content").findings
    assert finding.severity == "error" and "get_weather" in finding.evidence["first_dropped"]


@pytest.mark.planted("template-drops-content")
def test_a_template_without_a_system_role_drops_the_system_prompt(conversations):
    """Phi-3 mini's template without its system branch (its first revision had none): the system prompt of a
    third of the conversations is silently gone. The cause and the fix name the system role."""
    from hf_sanity.measure.encode import system_merged

    tok = real_tokenizer("phi3-instruct")
    tok.chat_template = tok.chat_template.replace(
        "{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif",
        "{% if",
    )
    assert "system" not in tok.chat_template
    (finding,) = run(tok, conversations, select="template-drops-content").findings
    with_system = [i for i, r in enumerate(conversations) if r["messages"][0]["role"] == "system"]
    assert finding.evidence["cause"] == "system-role-dropped" and finding.evidence["examples"] == len(
        with_system
    )
    assert finding.severity == "warning" and "system turn" in finding.message
    assert "Merge the system prompt into the first user turn" in finding.fix
    merged = [{"messages": system_merged(r["messages"]) or r["messages"]} for r in conversations]
    assert run(tok, merged, select="template-drops-content").findings == []  # the fix, applied


@pytest.mark.parametrize(
    "name", ["qwen2.5-instruct", "llama3-instruct", "deepseek-r1-distill", "phi3-instruct"]
)
@pytest.mark.clean("template-drops-content")
def test_templates_keep_plain_conversations_whole(name, conversations):
    assert run(real_tokenizer(name), conversations, select="template-drops-content").findings == []


@pytest.mark.planted("generation-markers-missing")
def test_assistant_only_loss_on_a_template_without_generation_markers(chatml, conversations):
    """ChatML has no {% generation %} markers: asked for assistant-only loss, its mask is empty. The remedy is
    this template with each answer wrapped, which renders every row as before (safe)."""
    (finding,) = run(chatml, conversations, select="generation-markers-missing", loss_on="assistant").findings
    assert finding.evidence["cause"] == "no-markers" and finding.evidence["conversations"] == len(
        conversations
    )
    # Asked by the flag alone (an Axolotl or LLaMA-Factory run needs no markers): a warning that says when it bites.
    assert finding.severity == "warning" and finding.evidence["asked_by"] == "flag"
    assert "assistant_only_loss=True" in finding.message
    remedy = finding.remedy
    assert remedy.safety == "safe" and remedy.detail["rows_rendered"] == len(conversations)
    assert remedy.detail["rows_rendered_differently"] == 0
    assert run(chatml, conversations, select="generation-markers-missing").findings == []  # not asked


def test_generation_markers_that_leave_the_end_of_turn_out(conversations):
    """Markers closed before `<|im_end|>`: the mask trains the answer but never the end of its turn."""
    tok = build_tokenizer("generation")
    tok.chat_template = tok.chat_template.replace(
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
        "{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>' }}",
    )
    (finding,) = run(tok, conversations, select="generation-markers-missing", loss_on="assistant").findings
    assert finding.evidence["cause"] == "markers-misplaced" and finding.remedy is None
    assert finding.evidence["answer_tokens_left_out"] > 0
    assert finding.evidence["other_tokens_in"] == 0


@pytest.mark.parametrize("name", ["generation", "qwen2.5-twin", "phi3-twin"])
@pytest.mark.clean("generation-markers-missing")
def test_templates_whose_markers_cover_the_answers_are_silent(name, conversations):
    """The tiny template with markers and TRL's training twins of real templates (their mask takes in the
    newline around the answer: the turn's own whitespace, not the prompt). The check compared masks: the
    same rows with the markers moved are caught (test above)."""
    from hf_sanity.measure.chat_templates import training_twin

    if name == "generation":
        tok = build_tokenizer("generation")
    else:
        # skipped, naming TRL's version, where TRL ships no such twin (TRL 0.24 ships no templates)
        setups.trl_template(name.removesuffix("-twin").replace(".", "_") + "_training")
        tok = real_tokenizer(name.removesuffix("-twin").replace("phi3", "phi3-instruct").replace(
            "qwen2.5", "qwen2.5-instruct"))  # fmt: skip
        tok.chat_template = training_twin(tok.chat_template)[1]
    assert run(tok, conversations, select="generation-markers-missing", loss_on="assistant").findings == []
