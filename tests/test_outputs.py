"""`hf_sanity.outputs`: what a fine-tuned model says for held-out prompts.

Each planted bug is a tiny model fine-tuned with that bug (`hf_sanity.testing.trained`, built once and cached:
the first run trains them, ~15 s each): its rule fires, and nothing else does; the correctly fine-tuned model
is silent on every rule. The detectors are also checked on hand-made generations at their thresholds, and the
generation itself (left padding, batching, the model left as it was) on the untrained tiny model.
"""

from __future__ import annotations

import copy
import json

import datasets
import pytest

import hf_sanity
from hf_sanity.errors import UserInputError
from hf_sanity.measure.generate import (
    END_OF_TURN,
    LENGTH,
    STOPPED,
    Generations,
    Sample,
    generate,
    held_out_prompts,
    prompts_from_tokens,
    repeated_run,
)
from hf_sanity.rules import outputs as rules
from hf_sanity.testing import (
    ADAPTER_PREFIX,
    as_prompt_completion,
    build_tokenizer,
    held_out_conversations,
    tiny_setup,
    trained_adapter_dir,
    trained_setup,
)

OUTPUT_RULES = [
    "never-stops",
    "stop-token-mismatch",
    "repeats-prompt",
    "stray-markers-in-output",
    "adapter-no-effect",
    "repetition-loop",
    "answer-truncated",
    "identical-outputs",
]


def check(model, tokenizer, rows, **kwargs):
    """outputs() on ``rows`` with every output rule (and no user config); no check may break."""
    data = rows if isinstance(rows, datasets.Dataset) else datasets.Dataset.from_list(rows)
    report = hf_sanity.outputs(model=model, tokenizer=tokenizer, dataset=data, use_config=False, **kwargs)
    broken = [f.message for f in report.findings if f.rule in ("internal-error", "checks-skipped")]
    assert broken == [], broken
    return report


def rules_of(report) -> set[str]:
    return {f.rule for f in report.findings}


@pytest.fixture(scope="module")
def held_out():
    return datasets.Dataset.from_list(held_out_conversations(32))


# -- the fine-tuned fixtures: each planted bug fires its rule, the clean model none ----------------------
@pytest.mark.slow
@pytest.mark.clean(
    "outputs",
    "answer-truncated",
    "never-stops",
    "repeats-prompt",
    "repetition-loop",
    "stray-markers-in-output",
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_correctly_fine_tuned_model_is_silent_with_margin(seed):
    """Three training seeds, each on its own set of held-out prompts: not one generation is judged faulty by
    any rule (the thresholds are shares of 10-90% of the generations; the clean model's are all 0)."""
    model, tok = trained_setup("clean", seed)
    rows = datasets.Dataset.from_list(held_out_conversations(48, seed=seed + 1))
    report = check(model, tok, rows, n=48)
    assert report.findings == []
    assert report.stats["prompts"] == 48 and report.stats["stopped"] == 48
    gens = generate(model, tok, held_out_prompts(rows, n=48))
    assert all(s.stop == STOPPED for s in gens.samples)
    assert not any(rules.echo_of(s) or rules.loops(s) or rules.truncated(s) for s in gens.samples)
    assert not any(rules._strays(gens, s) for s in gens.samples)


@pytest.mark.slow
@pytest.mark.planted("never-stops")
def test_a_model_trained_with_its_end_of_turn_masked_never_stops(held_out):
    model, tok = trained_setup("eos-masked")
    report = check(model, tok, held_out, max_new_tokens=96)
    assert "never-stops" in rules_of(report) <= {"never-stops", "repetition-loop"}  # it may also loop
    finding = report.by_rule("never-stops")[0]
    assert finding.severity == "error" and finding.evidence["fraction"] >= 0.9
    assert finding.evidence["cause"] == "eos-not-learned"
    assert finding.evidence["expected_stop"] == "<|im_end|>"
    assert "eos-not-learned" in finding.fix
    first = finding.example.examples[0]
    assert [label for label, _ in first.columns] == ["prompt", "generation", "reference"]
    # It answers first, then runs on: the reference answer is where it should have stopped.
    assert dict(first.columns)["generation"].startswith(dict(first.columns)["reference"].split()[0])


@pytest.mark.slow
@pytest.mark.planted("repeats-prompt")
def test_a_model_trained_with_the_prompt_in_its_answers_echoes_the_user_turn(held_out):
    model, tok = trained_setup("prompt-in-answer")
    report = check(model, tok, held_out)
    assert rules_of(report) == {"repeats-prompt"}
    (finding,) = report.findings
    assert finding.evidence["fraction"] >= 0.8 and "answer-repeats-prompt" in finding.fix
    sample = finding.example.examples[0]
    prompt = dict(sample.columns)["prompt"].split("] ")[-1]
    assert dict(sample.columns)["generation"].startswith(prompt)


@pytest.mark.slow
@pytest.mark.planted("stray-markers-in-output")
def test_a_model_served_with_another_chat_template_writes_its_markers_and_never_stops(held_out):
    model, tok = trained_setup("wrong-template")  # trained on ChatML, saved with a Llama-3 tokenizer
    report = check(model, tok, held_out, max_new_tokens=96)
    assert {"stray-markers-in-output", "never-stops"} <= rules_of(report)
    assert rules_of(report) <= {"stray-markers-in-output", "never-stops", "repetition-loop"}
    stray = report.by_rule("stray-markers-in-output")[0]
    assert stray.evidence["cause"] == "template-mismatch" and "<|im_end|>" in stray.evidence["markers"]
    assert "template-mismatch" in stray.fix
    assert "<|im_end|>" in stray.example.examples[0].marks
    never = report.by_rule("never-stops")[0]
    assert never.evidence["cause"] == "template-mismatch" and never.evidence["expected_stop"] == "<|eot_id|>"
    # Served with the tokenizer it was trained with, and a generation config that stops on that template's end of
    # turn (the folder's stops on <|eot_id|> only, and generate does not read the tokenizer), the weights are clean.
    _, own = trained_setup("clean")
    served = copy.deepcopy(model.generation_config)
    served.eos_token_id = [own.eos_token_id]
    report = check(model, tok, held_out, inference_tokenizer=own, generation_config=served, max_new_tokens=96)
    assert report.findings == []


@pytest.mark.slow
@pytest.mark.planted("answer-truncated")
def test_a_model_trained_on_cut_answers_stops_mid_sentence(held_out):
    model, tok = trained_setup("truncated")
    report = check(model, tok, held_out)
    assert rules_of(report) == {"answer-truncated"}
    (finding,) = report.findings
    assert finding.evidence["fraction"] >= 0.8 and max(finding.evidence["length_ratio"]) <= 0.5
    assert "truncated-completion" in finding.fix
    # Without references there is nothing to compare with: not judged.
    prompts_only = [{"messages": r["messages"][:-1]} for r in held_out_conversations(32)]
    assert "answer-truncated" not in rules_of(check(model, tok, prompts_only))


@pytest.mark.slow
@pytest.mark.planted("repetition-loop")
def test_a_barely_trained_model_repeats_itself(held_out):
    model, tok = trained_setup("undertrained")
    report = check(model, tok, held_out)
    assert "repetition-loop" in rules_of(report)
    finding = report.by_rule("repetition-loop")[0]
    assert finding.evidence["fraction"] >= 0.8
    assert finding.example.examples[0].marks  # the repeated unit is highlighted


@pytest.mark.slow
@pytest.mark.planted("adapter-no-effect")
def test_an_adapter_never_loaded_gives_the_base_models_outputs(held_out):
    model, tok = trained_setup("clean")
    base, _ = trained_setup("clean")
    report = check(model, tok, held_out, base=base, select="adapter-no-effect")
    (finding,) = report.findings
    assert finding.evidence["fraction"] == 1.0 and "adapter-not-loaded" in finding.fix
    assert [label for label, _ in finding.example.examples[0].columns][-1] == "base model"


@pytest.mark.slow
@pytest.mark.clean("adapter-no-effect")
def test_an_applied_adapter_changes_the_outputs_and_leaves_the_model_as_it_was(held_out):
    model, tok = trained_setup("clean")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = trained_adapter_dir()
    report = check(model, tok, held_out, adapter=adapter, base=model)  # the same object, adapter on and off
    assert report.findings == []
    assert report.stats["base_generation_seconds"] >= 0
    assert set(model.state_dict()) == set(before)  # the adapter's layers are gone again
    assert all((model.state_dict()[k] == v).all() for k, v in before.items())
    # A PEFT model object: the same, compared with a separate base model.
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), str(adapter))
    gens = generate(peft_model, tok, held_out_prompts(held_out, n=8))
    # The adapter is applied: its answers open with its prefix (most of them: on some CPUs one held-out prompt of
    # the tiny LoRA's goes "S Nairobi..." from the same seed).
    opened = [s.text.startswith(ADAPTER_PREFIX) for s in gens.samples]
    assert sum(opened) >= 6, [s.text for s in gens.samples]
    assert check(peft_model, tok, held_out, base=model, select="adapter-no-effect").findings == []
    # The PEFT model as its own base: compared with its adapter switched off.
    assert check(peft_model, tok, held_out, base=peft_model, select="adapter-no-effect").findings == []
    with pytest.raises(UserInputError, match="base is the fine-tuned model itself"):
        check(model, tok, held_out, base=model)


@pytest.mark.slow
@pytest.mark.planted("stop-token-mismatch")
def test_a_served_config_without_the_end_of_turn_is_caught_with_the_generations_that_ended_on_it(held_out):
    """The base checkpoint's EOS (<|endoftext|>) in the tokenizer and generation config: the model ends its
    answers with <|im_end|>, which the served stack never stops on."""
    from transformers import GenerationConfig

    model, tok = trained_setup("clean")
    tok = copy.deepcopy(tok)
    tok.eos_token = "<|endoftext|>"
    config = GenerationConfig(eos_token_id=tok.eos_token_id)
    report = check(model, tok, held_out, generation_config=config)
    assert rules_of(report) == {"stop-token-mismatch"}  # it stops where it should: never-stops stays silent
    (finding,) = report.findings
    assert finding.evidence["end_of_turn"] == "<|im_end|>" and finding.evidence["stop_tokens"] == [
        "<|endoftext|>"
    ]
    assert finding.evidence["ended_on_end_of_turn"] == finding.evidence["generations"] == 32
    assert finding.example.examples[0].note.startswith("stopped on <|im_end|>")  # side by side, as the others
    assert str(tok.convert_tokens_to_ids("<|im_end|>")) in finding.fix


# -- the detectors at their thresholds, on hand-made generations --------------------------------------------
def sample(row=0, *, text="The capital of France is Paris.", ids=None, stop=STOPPED, prompt="What is it?",
           reference=None, reference_tokens=None, base_ids=None, loop=(0, 0, 0), raw=None):  # fmt: skip
    ids = tuple(ids if ids is not None else [10 + len(text) % 7, 11, 12, 3])
    return Sample(
        row=row, prompt=prompt, sources=(prompt,), prompt_tokens=5, ids=ids, text=text,
        raw=text if raw is None else raw, stop=stop, reference=reference, reference_tokens=reference_tokens,
        base_ids=base_ids, base_text=None if base_ids is None else "base", loop_period=loop[0],
        loop_tokens=loop[1], loop_end=loop[2], loop_unit="x" if loop[0] else "",
    )  # fmt: skip


def gens(*samples, **kwargs) -> Generations:
    base = dict(
        samples=tuple(samples), max_new_tokens=16, stop_ids=frozenset({3}), served_stop_ids=frozenset({3}),
        end_of_turn_ids=(3,), end_of_turn="<|im_end|>", token_names={3: "<|im_end|>"},
        markers=("<|im_start|>", "<|im_end|>", "[INST]", "### Response:"), own_markers=("<|im_start|>", "<|im_end|>"),
    )  # fmt: skip
    base.update(kwargs)
    return Generations(**base)


def fired(detector, g) -> list:
    return list(detector(g) or ())


def test_never_stops_threshold_and_long_references():
    stopping = [sample(i) for i in range(8)]
    running = sample(8, ids=[5] * 16, stop=LENGTH, text="more and more")
    assert fired(rules.never_stops, gens(*stopping, running)) == []  # 1 of 9: under 20%
    two = [running, sample(9, ids=[6] * 16, stop=LENGTH)]
    (finding,) = fired(rules.never_stops, gens(*stopping, *two))
    assert finding.evidence["never_stopped"] == 2 and finding.rows == [8, 9]
    # An answer longer than max_new_tokens is not judged: its reference says so.
    long = [sample(8 + k, ids=[5] * 16, stop=LENGTH, reference="x", reference_tokens=40) for k in range(2)]
    assert fired(rules.never_stops, gens(*stopping, *long)) == []


def test_never_stops_names_the_served_templates_own_next_turn_eos_not_learned():
    """Generations that run on into the served template's own next turn (`<|im_start|>user`) did not learn
    the end of turn; only another template's markers make the cause template-mismatch."""
    own = [sample(i, ids=[5] * 16, stop=LENGTH, raw="Paris.\n<|im_start|>user\nAnd Rome?") for i in range(4)]
    (finding,) = fired(rules.never_stops, gens(*own))
    assert finding.evidence["cause"] == "eos-not-learned" and "eos_token_id" not in finding.fix
    assert finding.evidence["markers_written"] == {"<|im_start|>": 4} and "next turn" in finding.message
    foreign = [sample(i, ids=[5] * 16, stop=LENGTH, raw="Paris.[INST] And Rome?") for i in range(4)]
    (finding,) = fired(rules.never_stops, gens(*foreign))
    assert finding.evidence["cause"] == "template-mismatch" and "'[INST]'" in finding.fix


def test_restating_the_question_is_not_an_echo():
    restated = [
        sample(0, prompt="What is the capital of France?", text="The capital of France is Paris."),
        sample(1, prompt="What is 3 plus 4?", text="3 plus 4 is 7."),
        sample(2, prompt="Please spell the word cat backwards.", text="The word cat backwards is tac."),
    ]
    assert not any(rules.echo_of(s) for s in restated)
    assert fired(rules.repeats_prompt, gens(*restated)) == []
    echo = sample(3, prompt="What is the capital of France?", text="What is the capital of France? Paris.")
    assert rules.echo_of(echo)[1:] == (6, 6)
    labelled = sample(4, prompt="Name three colours please.", text="User: Name three colours please. Red.")
    assert rules.echo_of(labelled) is not None  # a role label before the copy
    (finding,) = fired(rules.repeats_prompt, gens(*restated, echo, labelled))
    assert finding.rows == [3, 4]


def test_stray_markers_cause_and_role_headers():
    foreign = [sample(i, raw="Paris. [INST] next", text="Paris. next") for i in range(3)]
    (finding,) = fired(rules.stray_markers_in_output, gens(*foreign, sample(3)))
    assert finding.evidence["cause"] == "template-mismatch" and finding.evidence["markers"] == {"[INST]": 3}
    own = [sample(i, raw="Paris.<|im_start|>user\nAnd Rome?") for i in range(3)]
    (finding,) = fired(rules.stray_markers_in_output, gens(*own, sample(3)))
    assert finding.evidence["cause"] == "runs-into-next-turn"
    header = [sample(i, raw="Paris.\nassistant\nRome.") for i in range(2)]
    (finding,) = fired(rules.stray_markers_in_output, gens(*header, *[sample(k) for k in range(2, 10)]))
    assert finding.evidence["markers"] == {"assistant": 2}
    assert fired(rules.stray_markers_in_output, gens(*[sample(k) for k in range(10)])) == []


def test_repeated_runs_are_found_in_token_ids():
    assert repeated_run([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == (0, 0, 0)
    assert repeated_run([9, 8] + [4] * 10) == (1, 10, 12)
    assert repeated_run([1, 5, 6, 5, 6, 5, 6, 5, 6, 5, 7]) == (2, 9, 10)  # 4.5 repeats, then a new token
    assert repeated_run([5, 6, 5, 6, 5, 6]) == (0, 0, 0)  # 3 repeats: not a loop
    short = sample(0, ids=list(range(20)), loop=(1, 5, 20), stop=LENGTH)
    long = sample(1, ids=list(range(20)), loop=(2, 12, 20), stop=LENGTH)
    assert not rules.loops(short) and rules.loops(long)


def test_truncated_answers_need_a_short_stop_mid_sentence():
    reference = "The capital of France is Paris, a city of many bridges."
    cut = sample(0, text="The capital of", ids=[1, 2, 3, 3], reference=reference, reference_tokens=12)
    complete = sample(1, text="Paris.", ids=[1, 3], reference=reference, reference_tokens=12)
    listing = sample(2, text="Red", ids=[1, 3], reference="Red, green", reference_tokens=4)  # no sentence end
    assert rules.truncated(cut) and not rules.truncated(complete)
    (finding,) = fired(rules.answer_truncated, gens(cut, complete, listing))
    assert finding.evidence["judged"] == 2 and finding.rows == [0]


def test_adapter_no_effect_needs_nearly_all_identical():
    same = [sample(i, ids=[1, 2, 3], base_ids=(1, 2, 3)) for i in range(9)]
    differs = sample(9, ids=[1, 2, 3], base_ids=(1, 4, 3))
    (finding,) = fired(rules.adapter_no_effect, gens(*same, differs, has_base=True))
    assert finding.evidence["identical"] == 9 and finding.evidence["differing_rows"] == [9]
    assert (
        fired(rules.adapter_no_effect, gens(*same[:8], differs, sample(10, base_ids=(7,)), has_base=True))
        == []
    )


@pytest.mark.planted("identical-outputs")
def test_one_answer_to_every_prompt_is_identical_outputs():
    """The sft_trl recipe's model: every held-out prompt answered with the same cut-off 'The capital of.'; each
    answer stops, none loops, none echoes: no other rule sees it."""
    questions = [
        "What is 2+2?",
        "Name a colour.",
        "Who wrote Hamlet?",
        "Spell cat.",
        "Largest planet?",
        "Say hi.",
    ]
    same = [
        sample(i, prompt=q, text="The capital of.", reference=f"Answer {i}.") for i, q in enumerate(questions)
    ]
    others = [sample(6, prompt="Capital of Peru?", text="Lima."), sample(7, prompt="3 times 3?", text="9.")]
    (finding,) = fired(rules.identical_outputs, gens(*same, *others))
    assert finding.rule == "identical-outputs" and finding.severity == "warning"  # 6 of 8: 75%
    assert finding.evidence["answer"] == "The capital of." and finding.evidence["share"] == 0.75
    assert finding.evidence["same_answer"] == 6 and finding.evidence["prompts"] == 8
    assert finding.evidence["other_rows"] == [6, 7] and finding.rows == list(range(6))
    assert "'The capital of.'" in finding.message and "75%" in finding.message
    (most,) = fired(rules.identical_outputs, gens(*same, *others[:1]))  # 6 of 7, as the recipe's: 86%
    assert most.severity == "error" and "whatever they ask" in most.message
    (every,) = fired(rules.identical_outputs, gens(*same))
    assert every.severity == "error" and every.evidence["share"] == 1.0
    assert every.example.examples[0].columns[1][1] == "The capital of."  # side by side: the generation


@pytest.mark.clean("identical-outputs")
def test_varied_answers_a_repeated_prompt_and_a_one_label_set_are_not_identical_outputs():
    questions = [
        "What is 2+2?",
        "Name a colour.",
        "Who wrote Hamlet?",
        "Spell cat.",
        "Largest planet?",
        "Say hi.",
    ]
    varied = [sample(i, prompt=q, text=f"Answer number {i}.") for i, q in enumerate(questions)]
    two_same = varied[:4] + [sample(4, prompt="Spell dog.", text="Answer number 0.")]
    assert fired(rules.identical_outputs, gens(*two_same)) == []  # 2 of 5: under half
    one_prompt = [sample(i, prompt="What is it?", text="Paris.") for i in range(8)]
    assert fired(rules.identical_outputs, gens(*one_prompt)) == []  # one prompt, asked 8 times
    labels = [sample(i, prompt=q, text="positive", reference="positive") for i, q in enumerate(questions)]
    assert fired(rules.identical_outputs, gens(*labels)) == []  # the references repeat it: a one-label set
    empty = [sample(i, prompt=q, text="", ids=[3]) for i, q in enumerate(questions)]
    assert fired(rules.identical_outputs, gens(*empty)) == []  # empty answers: answer-truncated's to judge
    # The detector judged these: the same samples with one answer fire.
    assert fired(
        rules.identical_outputs, gens(*[sample(i, prompt=q, text="Paris.") for i, q in enumerate(questions)])
    )


# -- generation: batched, left-padded, the model left as it was -----------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_setup("chatml", "distinct")
    return model, tok


def test_batched_left_padded_generation_equals_one_prompt_at_a_time(tiny):
    model, tok = tiny
    prompts = held_out_prompts(datasets.Dataset.from_list(held_out_conversations(6)), n=6)
    assert len({len(p.messages) for p in prompts}) > 1  # prompts of different lengths share a batch
    batched = generate(model, tok, prompts, max_new_tokens=12, batch_size=6)
    single = generate(model, tok, prompts, max_new_tokens=12, batch_size=1)
    assert [s.ids for s in batched.samples] == [s.ids for s in single.samples]
    assert generate(model, tok, prompts, max_new_tokens=12).samples == batched.samples  # deterministic


def test_generation_leaves_model_config_and_tokenizer_as_they_were(tiny):
    import torch

    model, tok = tiny
    model.train()
    model.model.layers[0].eval()  # a submodule the user keeps in eval mode
    config = model.generation_config.to_dict()
    side = tok.padding_side
    model(torch.ones((1, 4), dtype=torch.long, device="cpu")).logits.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    rng = torch.get_rng_state()
    generate(model, tok, held_out_prompts(datasets.Dataset.from_list(held_out_conversations(2)), n=2),
             max_new_tokens=4)  # fmt: skip
    assert model.training and not model.model.layers[0].training
    assert model.generation_config.to_dict() == config and tok.padding_side == side
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if n in grads)
    assert torch.equal(torch.get_rng_state(), rng)
    model.zero_grad(set_to_none=True)
    model.eval()


def test_generation_stops_on_the_end_of_turn_the_config_forgets(tiny):
    """The served config stops on <|endoftext|> only; generation still ends on <|im_end|>, marked as such."""
    from transformers import GenerationConfig

    model, tok = tiny
    tok = copy.deepcopy(tok)
    tok.eos_token = "<|endoftext|>"
    prompts = held_out_prompts(datasets.Dataset.from_list(held_out_conversations(2)), n=2)
    g = generate(model, tok, prompts, max_new_tokens=4, generation_config=GenerationConfig(eos_token_id=0))
    assert g.served_stop_ids == frozenset({0}) and g.stop_ids == frozenset({0, 3})
    assert g.expected_stop == "<|im_end|>"
    assert all(s.stop in (STOPPED, END_OF_TURN, LENGTH) for s in g.samples)


# -- prompts: every format's prompt side and reference ---------------------------------------------------------
def test_prompts_of_every_format():
    rows = held_out_conversations(4)
    (first, *_) = held_out_prompts(datasets.Dataset.from_list(rows), n=4)
    assert first.messages[-1]["role"] == "user" and first.reference == rows[0]["messages"][-1]["content"]
    pc = held_out_prompts(datasets.Dataset.from_list(as_prompt_completion(rows, conversational=True)), n=4)
    assert [p.reference for p in pc] == [r["messages"][-1]["content"] for r in rows]
    text = held_out_prompts(datasets.Dataset.from_list(as_prompt_completion(rows)), n=4)
    assert text[0].text is not None and text[0].messages is None
    only = held_out_prompts(datasets.Dataset.from_list([{"prompt": "Say hi."}]), n=1)
    assert only[0].text == "Say hi." and only[0].reference is None
    open_turn = held_out_prompts(datasets.Dataset.from_list([{"messages": rows[0]["messages"][:-1]}]), n=1)
    assert open_turn[0].reference is None and open_turn[0].messages[-1]["role"] == "user"
    sharegpt = [
        {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]}
    ]
    (sg,) = held_out_prompts(datasets.Dataset.from_list(sharegpt), n=1)
    assert sg.messages == ({"role": "user", "content": "Hi there"},) and sg.reference == "Hello!"
    alpaca = [{"instruction": "Greet me", "input": "", "output": "Hello!"}]
    (chat,) = held_out_prompts(datasets.Dataset.from_list(alpaca), n=1)
    assert chat.messages[-1]["content"] == "Greet me" and chat.reference == "Hello!"
    (plain,) = held_out_prompts(datasets.Dataset.from_list(alpaca), n=1, has_template=False)
    assert plain.text.endswith("### Response:\n") and plain.sources[0] == "Greet me"
    as_json = [{"messages": json.dumps(rows[0]["messages"])}]
    assert held_out_prompts(datasets.Dataset.from_list(as_json), n=1)[0].reference == first.reference
    spread = held_out_prompts(datasets.Dataset.from_list(held_out_conversations(20)), n=4)
    assert [p.row for p in spread] == [0, 6, 13, 19]


def test_prompts_of_a_trainers_tokenized_rows():
    tok = build_tokenizer("chatml")
    row = held_out_conversations(1)[0]
    ids = tok.apply_chat_template(row["messages"])["input_ids"]
    prompt_len = len(tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True)["input_ids"])
    labelled = {"input_ids": ids, "labels": [-100] * prompt_len + ids[prompt_len:]}
    (by_labels,) = prompts_from_tokens([labelled], tok, n=1)
    assert list(by_labels.ids) == ids[:prompt_len]
    assert by_labels.reference == row["messages"][-1]["content"]
    (by_markers,) = prompts_from_tokens([{"input_ids": ids}], tok, n=1)
    assert by_markers.ids == by_labels.ids and by_markers.reference == by_labels.reference


# -- bad input: one line, before any generation ---------------------------------------------------------------
def test_bad_input_is_one_clear_error(tiny):
    model, tok = tiny
    rows = held_out_conversations(4)
    with pytest.raises(UserInputError, match="--n must be a positive integer"):
        check(model, tok, rows, n=0)
    with pytest.raises(UserInputError, match="--max-new-tokens"):
        check(model, tok, rows, max_new_tokens=-1)
    with pytest.raises(UserInputError, match="has no prompts"):
        check(model, tok, [{"text": "Just prose."}])
    with pytest.raises(UserInputError, match="none of its 2 rows has a prompt side"):
        check(model, tok, [{"messages": [{"role": "assistant", "content": "Hi"}]}] * 2)
    base = build_tokenizer("base")
    with pytest.raises(UserInputError, match="no chat template"):
        check(model, base, rows)
    # Plain-text prompts need no chat template.
    assert check(model, base, as_prompt_completion(rows), max_new_tokens=4).stats["prompts"] == 4
    # A template that rejects some rows: those are left out and said; all of them: one line.
    picky = copy.deepcopy(tok)
    picky.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    six = held_out_conversations(6)
    system = [i for i, r in enumerate(six) if r["messages"][0]["role"] == "system"]
    assert 0 < len(system) < 6
    report = check(model, picky, six, max_new_tokens=4)
    skipped = report.stats["prompts_not_rendered"]
    assert skipped["rows"] == system and "no system turns" in skipped["first_problem"]
    assert report.stats["prompts"] == 6 - len(system)
    with_system = [r for r in held_out_conversations(12) if r["messages"][0]["role"] == "system"]
    with pytest.raises(UserInputError, match="cannot render any of the prompts"):
        check(model, picky, with_system, max_new_tokens=4)


# -- the report: side by side in the terminal, JSON and HTML -----------------------------------------------------
def test_side_by_side_in_terminal_json_and_html(tmp_path):
    from rich.console import Console

    from hf_sanity.html import render_html

    raw = "Paris.<|im_start|>user\n<b>And</b> Rome?"
    g = gens(*[sample(i, raw=raw, reference="Paris.") for i in range(3)])
    report = hf_sanity.Report(title="hf-sanity outputs", findings=fired(rules.stray_markers_in_output, g))
    console = Console(record=True, width=120)
    console.print(report)
    text = console.export_text()
    assert all(word in text for word in ("prompt", "generation", "reference", "What is it?"))
    data = report.to_dict()["findings"][0]
    assert data["side_by_side"][0] == {
        "row": 0, "prompt": "What is it?", "generation": raw, "reference": "Paris.",
        "note": "stopped on <|im_end|> after 4 tokens",
    }  # fmt: skip
    assert len(data["side_by_side"]) == 3 and "generation:" in data["example"]
    page = render_html(report)
    assert '<table class="sidebyside" data-row="0">' in page
    assert '<mark class="stray">&lt;|im_start|&gt;</mark>' in page
    assert "<b>And</b>" not in page and "&lt;b&gt;And&lt;/b&gt;" in page


# -- during training: SanityCallback(generate_every=N, generate_prompts=K) ----------------------------------
def tokenized(tok, rows, *, labels: bool = True) -> datasets.Dataset:
    from hf_sanity.testing.trained import supervised_labels

    out = []
    for row in rows:
        ids, labs = supervised_labels(tok, row["messages"])
        out.append({"input_ids": ids, "labels": labs} if labels else {"input_ids": ids})
    return datasets.Dataset.from_list(out)


def test_generation_check_validates_and_waits_for_its_step(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from hf_sanity.callback import SanityCallback
    from hf_sanity.training.generation import GenerationCheck

    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="generate_every"):
            SanityCallback(generate_every=bad)
    with pytest.raises(ValueError, match="generate_prompts"):
        SanityCallback(generate_every=10, generate_prompts=0)
    with pytest.raises(ValueError, match="generate_prompts"):
        SanityCallback(generate_every=10, generate_prompts=[])
    assert SanityCallback().generation is None  # off by default
    check = GenerationCheck(100)
    assert [check.due(s) for s in (50, 100)] == [False, True]
    check.last = 100
    assert [check.due(s) for s in (150, 200)] == [False, True]
    # A second train() with the same callback starts its checks over, as at its first.
    callback = SanityCallback(generate_every=100, use_config=False)
    callback.generation.last, callback.generation.checks = 200, 2
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    model, _ = tiny_setup("chatml")
    callback.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    assert callback.generation.checks == 0 and callback.generation.due(100)


@pytest.mark.slow
def test_generation_check_on_a_trainers_tokenized_eval_rows():
    """The plain object, without a Trainer: prompts from tokenized eval rows (labels mark the answer), the
    outputs rules at the given step, a budget of twice the longest reference."""
    from hf_sanity.selection import resolve
    from hf_sanity.training.generation import GenerationCheck

    selection = resolve(use_config=False)
    model, tok = trained_setup("eos-masked")
    check = GenerationCheck(10, 4)
    prompts = check.prompts_for(tok, tokenized(tok, held_out_conversations(16)))
    assert len(prompts) == 4 and all(p.ids and p.reference for p in prompts)
    assert check.budget(tok, prompts) == 32  # short references: 2 x ~8 + 16
    found = check.check(model, tok, prompts, selection, step=10)
    assert [(f.rule, f.step) for f in found if f.rule == "never-stops"] == [("never-stops", 10)]
    clean, tok = trained_setup("clean")
    assert check.check(clean, tok, prompts, selection, step=20) == []
    rows = GenerationCheck(10, held_out_conversations(3)).prompts_for(tok, None)  # rows given directly
    assert [p.reference is not None for p in rows] == [True] * 3


def train_with_generation(tmp_path, *, trap: bool, steps: int, every: int, eval_every: int):
    """A real Trainer run of the tiny model with evaluations every ``every`` steps and the output check on.
    ``trap``: pad == EOS and a language-modelling collator that masks every pad token, EOS included."""
    import torch
    from transformers import (
        DataCollatorForLanguageModeling,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainingArguments,
    )

    from hf_sanity.callback import SanityCallback
    from hf_sanity.testing import TinyConfig, demo_conversations, tiny_model_for

    tok = build_tokenizer("chatml", "eos" if trap else "distinct")
    model = tiny_model_for(tok, TinyConfig())
    train = tokenized(tok, demo_conversations(256), labels=not trap)
    held = tokenized(tok, held_out_conversations(16), labels=not trap)
    collator = DataCollatorForLanguageModeling(tok, mlm=False) if trap else DataCollatorForSeq2Seq(tok)
    callback = SanityCallback(
        "error",
        select="outputs",
        use_config=False,
        print_findings=False,
        generate_every=every,
        generate_prompts=8,
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=32, learning_rate=3e-3,
        lr_scheduler_type="constant", eval_strategy="steps", eval_steps=eval_every, logging_steps=50,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=train, eval_dataset=held, data_collator=collator,
        processing_class=tok, callbacks=[callback],
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model trains several times faster on one thread
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    return trainer, callback


@pytest.mark.slow
@pytest.mark.planted("never-stops")
def test_a_run_that_will_never_stop_is_caught_at_its_first_checked_evaluation(tmp_path):
    trainer, callback = train_with_generation(tmp_path, trap=True, steps=300, every=150, eval_every=75)
    (finding,) = callback.report.findings
    assert finding.rule == "never-stops" and finding.step == 150  # evaluations at 75 (too early) and 150
    assert trainer.state.global_step < 300  # abort_on="error": the run stopped there
    assert callback.report.stats["generate"] == {"every": 150, "checks": 1, "prompts": 8, "last_step": 150}
    written = json.loads((tmp_path / "out" / "hf-sanity" / "report.json").read_text())
    assert written["findings"][0]["side_by_side"][0]["prompt"]


@pytest.mark.slow
@pytest.mark.clean("outputs")
def test_a_correct_run_generates_at_its_evaluations_and_stays_silent(tmp_path):
    trainer, callback = train_with_generation(tmp_path, trap=False, steps=250, every=100, eval_every=125)
    assert callback.report.findings == []
    assert trainer.state.global_step == 250
    assert callback.report.stats["generate"]["checks"] == 2  # at steps 125 and 250
    assert callback.report.stats["callback_seconds_by_check"]["outputs"] < 5


@pytest.mark.parametrize(
    "name",
    [
        "qwen2.5-instruct",
        "llama3-instruct",
        "mistral-instruct",
        "phi3-instruct",
        "deepseek-r1-distill",
        "tinyllama-chat",
    ],
)
def test_real_tokenizers_render_generate_and_check_without_breaking(name):
    """Real families' templates and special tokens, on a tiny random model matching each vocabulary: every
    rule runs (none breaks), the served stops are the family's, and what the random model writes is judged."""
    from conftest import real_tokenizer
    from hf_sanity.testing import TinyConfig, tiny_model_for

    tok = real_tokenizer(name)
    model = tiny_model_for(tok, TinyConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    rows = held_out_conversations(4)
    if name == "mistral-instruct":  # its template takes no system turn
        rows = [{"messages": [m for m in r["messages"] if m["role"] != "system"]} for r in rows]
    report = check(model, tok, rows, max_new_tokens=12)
    assert report.stats["prompts"] == 4 and "prompts_not_rendered" not in report.stats
    assert "stop-token-mismatch" not in rules_of(report)  # tiny_model_for ships the family's stop tokens


def test_output_rules_read_the_generations_and_never_change_them():
    """Every `outputs` detector on one Generations that trips all of them: each fires, none breaks, and what
    they read is the same object, equal to a copy taken before (the dataclasses are frozen, too)."""
    import dataclasses

    from hf_sanity import catalog

    bad = [
        sample(
            i,
            raw="What is it? [INST] x x x x x x x x x",
            text="What is it? x x x x x x x x x",
            stop=LENGTH,
            ids=[7] * 16,
            reference="A full answer here.",
            reference_tokens=8,
            base_ids=tuple([7] * 16),
            loop=(1, 15, 16),
        )
        for i in range(4)
    ]
    cut = [
        sample(
            4 + i,
            prompt=f"What is it, {i}?",  # four prompts, one answer: identical-outputs
            text="The",
            ids=[1, 3],
            reference=f"The answer {i} is long.",
            reference_tokens=8,
            base_ids=(1, 3),
        )
        for i in range(4)
    ]
    g = gens(
        *bad, *cut, has_base=True, served_stop_ids=frozenset({0}), token_names={0: "<eos>", 3: "<|im_end|>"}
    )
    before = copy.deepcopy(g)
    fired_rules = set()
    for detector in catalog.detectors("outputs"):
        for finding in catalog.run(detector, g):
            assert finding.rule != "internal-error", finding.message
            fired_rules.add(finding.rule)
    assert fired_rules == set(OUTPUT_RULES)
    assert g == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.samples = ()
