"""The tiny Qwen3-MoE (16 experts, 2 per token, 2 MoE layers: `hf_sanity.testing.moe`) under a plain `Trainer` and
TRL's `SFTTrainer`, as a user builds them: loaded from its folder, a few steps on the CPU."""

from __future__ import annotations

import datasets
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_sanity.testing.moe import tiny_moe_dir


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny MoE is overhead-bound: one thread runs it several times faster on a shared machine (autouse in
    the test modules that import it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def folder():
    return tiny_moe_dir()


def load(**kwargs):
    """(model, tokenizer) from the cached folder; ``kwargs`` go to ``from_pretrained`` (config overrides)."""
    return AutoModelForCausalLM.from_pretrained(folder(), **kwargs), AutoTokenizer.from_pretrained(folder())


def sft_turns_the_aux_loss_on() -> bool:
    """Whether TRL's SFTTrainer turns a MoE's load-balancing loss on itself (its SFTConfig has
    `router_aux_loss_coef`, TRL 1.x); an older one (TRL 0.24) leaves it to the model config's
    `output_router_logits`, as a plain Trainer does."""
    import dataclasses

    from trl import SFTConfig

    return "router_aux_loss_coef" in {f.name for f in dataclasses.fields(SFTConfig)}


def load_for_sft(**kwargs):
    """(model, tokenizer) as a user of the installed TRL loads the MoE for SFT with the load-balancing loss on:
    as it is where SFTTrainer turns the loss on itself, else with `output_router_logits=True` (TRL 0.24's way)."""
    if not sft_turns_the_aux_loss_on():
        kwargs.setdefault("output_router_logits", True)
    return load(**kwargs)


def plain_trainer(tmp_path, model, tok, *, callbacks=(), n: int = 32, **overrides):
    """transformers' `Trainer` on the demo chats, labels on the answers (``tests/dist/tinytrain``)."""
    from dist import tinytrain as tt

    return tt.trainer(
        tmp_path, callbacks=list(callbacks), model=model, tok=tok, data=tt.rows(tok, n), **overrides
    )


def sft_trainer(tmp_path, model, tok, *, callbacks=(), n: int = 32, peft_config=None, **overrides):
    """TRL's `SFTTrainer` on the demo chats (completion-only loss, as TRL defaults for prompt-completion rows)."""
    from trl import SFTConfig, SFTTrainer

    from hf_sanity.testing import as_prompt_completion, demo_conversations

    data = datasets.Dataset.from_list(as_prompt_completion(demo_conversations(n), conversational=True))
    config = {
        "output_dir": str(tmp_path), "max_steps": 6, "per_device_train_batch_size": 4, "learning_rate": 3e-3,
        "logging_steps": 1, "report_to": [], "save_strategy": "no", "use_cpu": True, "seed": 0,
        "disable_tqdm": True, "max_length": 128, "lr_scheduler_type": "constant", "bf16": False, **overrides,
    }  # fmt: skip
    return SFTTrainer(
        model=model, args=SFTConfig(**config), train_dataset=data, processing_class=tok,
        callbacks=list(callbacks), peft_config=peft_config,
    )  # fmt: skip


class BiasRouter:
    """A TrainerCallback that, at ``step``, biases one row of every router towards the mean of the tokens it
    routes, so that expert ``expert`` takes one of each token's two slots: a router collapsing mid-run. The mean
    is the one of the step's own tokens, read at each router's input (a fixed direction would depend on where
    the trained model's hidden states happen to point)."""

    def __init__(self, step: int = 4, expert: int = 0, scale: float = 50.0) -> None:
        self.step, self.expert, self.scale = step, expert, scale
        self.done = False
        self.means: dict[str, object] = {}  # router name -> the mean input of its latest training forward
        self.hooks: list = []

    def __call__(self):  # a TrainerCallback built lazily (transformers imported by the caller)
        from transformers import TrainerCallback

        planter = self

        class Plant(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                planter.watch(model)
                return control

            def on_step_end(self, args, state, control, model=None, **kwargs):
                if state.global_step == planter.step and not planter.done:
                    planter.plant(model)
                return control

            def on_train_end(self, args, state, control, **kwargs):
                for hook in planter.hooks:
                    hook.remove()
                return control

        return Plant()

    def watch(self, model) -> None:
        from hf_sanity.measure.moe import routers_of

        for name, router in routers_of(model).modules:

            def keep(module, args, _name=name):
                if module.training:
                    hidden = args[0].detach()
                    self.means[_name] = hidden.reshape(-1, hidden.shape[-1]).mean(0)

            self.hooks.append(router.register_forward_pre_hook(keep))

    def plant(self, model) -> None:
        import torch

        from hf_sanity.measure.moe import routers_of

        with torch.no_grad():
            for name, router in routers_of(model).modules:
                row = router.weight[self.expert]
                mean = self.means.get(name)
                direction = torch.ones_like(row) if mean is None else mean.to(row.dtype)
                row.add_(self.scale * direction / direction.norm())
        self.done = True
