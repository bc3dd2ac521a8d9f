"""A tiny LLaVA built from its configs: a 1-layer CLIP vision tower (32x32 images in 8x8 patches: 16 image tokens
a picture, the CLS token dropped) and a 2-layer Qwen2 text model, on the real Qwen2.5 tokenizer with `<image>`
added; its processor (CLIP's image processor, through transformers' PIL path) and a ChatML chat template that
renders TRL's image content parts and marks the assistant turns with ``{% generation %}``.

Plus the VLM datasets the tests and the recipe train on: conversational rows (``messages`` + ``images``) and
prompt-completion rows, each with its own small PIL images.

:func:`tiny_idefics3_dir` is the family with a dynamic image-token count (Idefics3 / SmolVLM: each picture split
into tiles, a global image beside them), through transformers' PIL image processor. Qwen2-VL's processor cannot
be built here: its video processor needs torchvision, and the registry's torchvision is a CUDA build that fails
beside the CPU torch of this venv.
"""

from __future__ import annotations

from pathlib import Path

from hf_sanity.testing.factory import _build_atomically, _key, cache_root

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH_SIZE = 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # per picture, CLS dropped ("default" feature strategy)

# ChatML that renders TRL's content parts ({"type": "image"} -> <image>, {"type": "text"} -> its text) and marks
# each assistant turn for `assistant_only_loss` (`return_assistant_tokens_mask`).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% for part in parts %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{% for part in parts %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def real_qwen_tokenizer_dir() -> Path:
    """../shared/real-tokenizers/qwen2.5-instruct beside the checkout."""
    return Path(__file__).resolve().parents[3] / "shared" / "real-tokenizers" / "qwen2.5-instruct"


def tiny_llava_dir(seed: int = 0) -> Path:
    """A cached folder with the tiny LLaVA, its processor and tokenizer, loadable with `from_pretrained`."""
    source = real_qwen_tokenizer_dir()
    if not source.is_dir():
        from hf_sanity.errors import UserInputError

        raise UserInputError(f"the tiny LLaVA needs the real Qwen2.5 tokenizer at {source}")
    final = cache_root() / f"tiny-llava-{_key(kind='llava', seed=seed, template=CHAT_TEMPLATE, v=1)}"

    def build(folder: Path) -> None:
        import torch
        from transformers import (
            AutoTokenizer,
            CLIPImageProcessor,
            CLIPVisionConfig,
            LlavaConfig,
            LlavaForConditionalGeneration,
            LlavaProcessor,
            Qwen2Config,
        )

        tokenizer = AutoTokenizer.from_pretrained(source)
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
        tokenizer.chat_template = CHAT_TEMPLATE
        image_processor = CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        )
        processor = LlavaProcessor(
            image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
            vision_feature_select_strategy="default", num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE,
        )  # fmt: skip
        vision = CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32,
        )  # fmt: skip
        text = Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
        )  # fmt: skip
        config = LlavaConfig(
            vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
            vision_feature_select_strategy="default", vision_feature_layer=-1,
        )  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            LlavaForConditionalGeneration(config).save_pretrained(folder)
        processor.save_pretrained(folder)

    return _build_atomically(final, build)


def load_tiny_llava(seed: int = 0):
    """(model, processor) of :func:`tiny_llava_dir`."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    folder = tiny_llava_dir(seed)
    return LlavaForConditionalGeneration.from_pretrained(folder), AutoProcessor.from_pretrained(folder)


QUESTIONS = (
    "What is in the picture?",
    "Describe the image.",
    "What colour dominates?",
    "Is it bright or dark?",
)
ANSWERS = (
    "A red square.",
    "A blue field.",
    "Mostly green.",
    "It is bright.",
    "A grey patch.",
    "Dark stripes.",
)


def image(index: int, wide: bool = False):
    """A distinct small RGB picture for ``index`` (no two indices alike); ``wide``: 4:1 (fewer tiles for a
    processor that splits images)."""
    from PIL import Image

    r, g, b = (index * 37) % 256, (index * 91 + 40) % 256, (index * 53 + 90) % 256
    size = (4 * IMAGE_SIZE, IMAGE_SIZE) if wide else (IMAGE_SIZE + 8 * (index % 3), IMAGE_SIZE)
    picture = Image.new("RGB", size, (r, g, b))
    picture.putpixel((index % IMAGE_SIZE, 0), (255 - r, 255 - g, 255 - b))
    return picture


def vlm_messages(rows: int = 16, images_in: dict[int, int] | None = None, wide: frozenset[int] = frozenset()):
    """A TRL conversational VLM dataset: ``messages`` whose user turn holds image parts, and ``images``.
    ``images_in`` maps a row index to its number of images (default 1), ``wide`` the rows of wide pictures;
    the same questions recur over different pictures, as in real VLM data."""
    import datasets

    images_in = images_in or {}
    out = {"messages": [], "images": []}
    for row in range(rows):
        count = images_in.get(row, 1)
        parts = [{"type": "image"} for _ in range(count)]
        parts.append({"type": "text", "text": QUESTIONS[row % len(QUESTIONS)]})
        out["messages"].append(
            [
                {"role": "user", "content": parts},
                {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[row % len(ANSWERS)]}]},
            ]
        )
        out["images"].append([image(row * 4 + k, wide=row in wide) for k in range(count)])
    return datasets.Dataset.from_dict(out)


def vlm_prompt_completion(
    rows: int = 16, images_in: dict[int, int] | None = None, wide: frozenset[int] = frozenset()
):
    """The same rows as TRL's conversational prompt-completion VLM data (completion-only loss by default)."""
    import datasets

    data = vlm_messages(rows, images_in, wide)
    return datasets.Dataset.from_dict(
        {
            "prompt": [m[:1] for m in data["messages"]],
            "completion": [m[1:] for m in data["messages"]],
            "images": data["images"],
        }
    )


class MaskingCollator:
    """The tutorials' VLM collator done right: each conversation rendered by the processor's chat template
    with its pictures, labels = input_ids with the padding, the vision tokens and every token before the
    assistant's answer set to -100 (``mask_vision=False`` keeps the vision tokens' labels: the tutorials' bug).
    Used with ``SFTConfig(dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)``."""

    def __init__(self, processor, *, mask_vision: bool = True, mask_prompt: bool = True) -> None:
        self.processor, self.mask_vision, self.mask_prompt = processor, mask_vision, mask_prompt
        tokenizer = processor.tokenizer
        self.image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.answer_start = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def __call__(self, examples):

        texts = [self.processor.apply_chat_template(e["messages"], tokenize=False) for e in examples]
        images = [e["images"] for e in examples]
        batch = self.processor(text=texts, images=images, padding=True, return_tensors="pt")
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        if self.mask_vision:
            labels[labels == self.image_id] = -100
        if self.mask_prompt:
            width = len(self.answer_start)
            for row in range(labels.shape[0]):
                ids = batch["input_ids"][row].tolist()
                starts = [i for i in range(len(ids) - width + 1) if ids[i : i + width] == self.answer_start]
                labels[row, : starts[0] + width if starts else len(ids)] = -100
        batch["labels"] = labels
        return batch


def vlm_sft_trainer(
    output_dir,
    data,
    *,
    model=None,
    processor=None,
    collator=None,
    callbacks=(),
    peft_config=None,
    **overrides,
):
    """TRL's SFTTrainer on the tiny LLaVA (a fresh one unless given), CPU, a few steps, nothing saved; with
    ``peft_config``, TRL wraps the model in that adapter."""
    from trl import SFTConfig, SFTTrainer

    if model is None or processor is None:
        model, processor = load_tiny_llava()
    config = {
        "output_dir": str(output_dir), "max_steps": 2, "per_device_train_batch_size": 4, "learning_rate": 1e-3,
        "logging_steps": 1, "report_to": [], "save_strategy": "no", "use_cpu": True, "bf16": False, "seed": 0,
        "disable_tqdm": True, "max_length": None, **overrides,
    }  # fmt: skip
    if collator is not None:
        config.update(dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)
    return SFTTrainer(
        model=model, args=SFTConfig(**config), train_dataset=data, processing_class=processor,
        data_collator=collator, callbacks=list(callbacks), peft_config=peft_config,
    )  # fmt: skip


IDEFICS_TILE = 32  # each tile (and the global image) 32x32 in 8x8 patches, merged 2x2: 4 tokens a tile


def tiny_idefics3_dir(seed: int = 0) -> Path:
    """A cached tiny Idefics3 (SmolVLM's architecture: image splitting into tiles, a dynamic image-token count
    that grows with the resolution): a 1-layer SigLIP-style tower, a 2-layer Llama text model, on the real
    Qwen2.5 tokenizer with Idefics3's image tokens added."""
    source = real_qwen_tokenizer_dir()
    final = cache_root() / f"tiny-idefics3-{_key(kind='idefics3', seed=seed, template=CHAT_TEMPLATE, v=2)}"

    def build(folder: Path) -> None:
        import torch
        from transformers import (
            AutoTokenizer,
            Idefics3Config,
            Idefics3ForConditionalGeneration,
            Idefics3ImageProcessor,
            Idefics3Processor,
        )

        tokenizer = AutoTokenizer.from_pretrained(source)
        tokenizer.add_special_tokens(
            {"additional_special_tokens": [IMAGE_TOKEN, "<fake_token_around_image>", "<global-img>"]}
        )
        tokenizer.chat_template = CHAT_TEMPLATE
        image_processor = Idefics3ImageProcessor(
            size={"longest_edge": 2 * IDEFICS_TILE}, max_image_size={"longest_edge": IDEFICS_TILE},
            do_image_splitting=True,
        )  # fmt: skip
        processor = Idefics3Processor(
            image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=CHAT_TEMPLATE
        )
        config = Idefics3Config(
            vision_config={
                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                "image_size": IDEFICS_TILE, "patch_size": 8,
            },
            text_config={
                "model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 1024, "pad_token_id": tokenizer.pad_token_id,
                "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"), "tie_word_embeddings": False,
            },
            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), scale_factor=2,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            Idefics3ForConditionalGeneration(config).save_pretrained(folder)
        processor.save_pretrained(folder)

    return _build_atomically(final, build)


def load_tiny_idefics3(seed: int = 0):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    folder = tiny_idefics3_dir(seed)
    return Idefics3ForConditionalGeneration.from_pretrained(folder), AutoProcessor.from_pretrained(folder)
