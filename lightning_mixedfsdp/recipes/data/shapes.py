"""The generated image-text task of ``conf/shapes_vlm.yaml``: coloured shapes on a grey field, each with a question
about its colour or its shape, and a text-only row now and then (real image-text data mixes both, so ranks see
different inputs). Deterministic in the index, made in memory on every rank: no files, no download.

Its processor is made here too: a Llava processor (``LlavaProcessor``: a SigLIP image processor at 32x32 pixels, a
word-level tokenizer over the task's words, a chat template), saved into the run's export beside the weights."""

from typing import Any, Dict, Iterator, List, Tuple

import torch

COLORS: Dict[str, Tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
    "purple": (140, 60, 180),
    "orange": (240, 140, 30),
}
SHAPES = ("circle", "square", "triangle")
IMAGE_SIZE = 32
PATCH_SIZE = 8
QUESTIONS = {"color": "what color is the shape ?", "shape": "what shape is this ?"}
TEXT_ONLY_EVERY = 5
"""Every fifth row has no image: it asks to repeat two words."""

SPECIAL = ("<pad>", "<unk>", "<image>", "<|user|>", "<|assistant|>", "<|end|>")
WORDS = tuple(
    dict.fromkeys(
        [w for q in QUESTIONS.values() for w in q.split()] + [*COLORS, *SHAPES, "repeat", ":"],
    )
)
VOCABULARY = (*SPECIAL, *WORDS)
"""Every token id of the task, in order: the model's ``vocab_size`` must hold them (``conf/shapes_vlm.yaml``: 32)."""
IMAGE_TOKEN_ID = VOCABULARY.index("<image>")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}"
    "{% endfor %}{% endif %}<|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
"""Role markers, one ``<image>`` per image part, words apart by spaces, ``<|end|>`` after each turn."""


def shape_image(color: str, shape: str, generator: torch.Generator) -> Any:
    """A ``IMAGE_SIZE`` square of light grey noise with one shape of ``color`` at a random place and size."""
    from PIL import Image, ImageDraw

    noise = torch.randint(150, 200, (IMAGE_SIZE, IMAGE_SIZE, 1), generator=generator).expand(-1, -1, 3)
    image = Image.fromarray(noise.to(torch.uint8).contiguous().numpy(), mode="RGB")
    size = int(torch.randint(12, 25, (), generator=generator))
    left = int(torch.randint(0, IMAGE_SIZE - size + 1, (), generator=generator))
    top = int(torch.randint(0, IMAGE_SIZE - size + 1, (), generator=generator))
    box = (left, top, left + size - 1, top + size - 1)
    draw, fill = ImageDraw.Draw(image), COLORS[color]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(left + size // 2, top), (left, top + size - 1), (left + size - 1, top + size - 1)], fill=fill)
    return image


def shapes_records(count: int = 4000, seed: int = 0) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """``(where, record)`` for ``count`` rows in trl's vision format, the images in memory (PIL)."""
    generator = torch.Generator().manual_seed(seed)
    colors = list(COLORS)
    for index in range(count):
        color = colors[int(torch.randint(len(colors), (), generator=generator))]
        shape = SHAPES[int(torch.randint(len(SHAPES), (), generator=generator))]
        where = f"generated shapes row {index}"
        if index % TEXT_ONLY_EVERY == TEXT_ONLY_EVERY - 1:
            user = [{"type": "text", "text": f"repeat : {color} {shape}"}]
            answer = f"{color} {shape}"
            yield where, {"messages": _turns(user, answer), "images": []}
            continue
        asked = "color" if int(torch.randint(2, (), generator=generator)) == 0 else "shape"
        image = shape_image(color, shape, generator)
        user = [{"type": "image"}, {"type": "text", "text": QUESTIONS[asked]}]
        yield where, {"messages": _turns(user, color if asked == "color" else shape), "images": [image]}


def _turns(user: List[Dict[str, str]], answer: str) -> List[Dict[str, Any]]:
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]


def shapes_processor() -> Any:
    """The task's ``LlavaProcessor``: ``IMAGE_SIZE`` pixels in ``(IMAGE_SIZE / PATCH_SIZE)**2`` image tokens, a
    word-level tokenizer over :data:`VOCABULARY`, :data:`CHAT_TEMPLATE`; ``<|end|>`` is its end of turn (EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlavaProcessor, PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCABULARY)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|end|>",
        extra_special_tokens={"image_token": "<image>"},
        chat_template=CHAT_TEMPLATE,
    )
    return LlavaProcessor(
        image_processor=_siglip_image_processor(),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="full",
        image_token="<image>",
        num_additional_image_tokens=0,
        chat_template=CHAT_TEMPLATE,
    )


def _siglip_image_processor() -> Any:
    """SigLIP's image processor at ``IMAGE_SIZE``: its PIL backend where transformers has one (no torchvision)."""
    import transformers

    # SiglipImageProcessorPil: transformers 5; older ones have the PIL code under the plain name
    image_processor = getattr(transformers, "SiglipImageProcessorPil", None) or transformers.SiglipImageProcessor
    return image_processor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
