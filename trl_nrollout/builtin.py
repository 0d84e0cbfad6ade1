"""The embedded default: a tiny causal LM built on the spot, a synthetic prompt set and a learnable reward.

``builtin:tiny-qwen2`` names a Qwen2-style model with random weights (hidden 128, 2 layers, about 0.2 M
parameters) and a byte-level BPE tokenizer trained on a small built-in corpus. It is built once, saved under
the cache folder (``$TRL_NROLLOUT_CACHE`` or ``~/.cache/trl_nrollout``) and reused; every process of a launch
gets the same files. Any hub id or local path works wherever a ``builtin:`` name does.

The built-in task, ``digits``: each prompt asks for a number; the reward is the fraction of the completion's
non-space characters that are digits (0 for an empty completion). A random model writes mostly letters and
punctuation (reward about 0.2); GRPO visibly raises it within a few dozen steps on 2 CPU cores. The embedded default
adds ``short_answer`` (an answer that ends within a few tokens), so the answers it learns end instead of running
to ``max_completion_length``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
_BUILDERS_VERSION = "v1"

#: How much ``tiny-qwen2-longtail`` scales the end-of-text token's (tied) embedding row.
EOS_SCALE_LONGTAIL = 24.0

#: Model sizes that can be asked for by name: ``builtin:<name>``.
BUILTIN_MODELS: dict[str, dict] = {
    "tiny-qwen2": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=384),
    "small-qwen2": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=4, vocab_size=1024),
    # between small and a real model, for benchmarks at user-sized prompts: 26 M parameters, a forward of about
    # 1,400 tokens/s on 2 CPU cores; 4,096 positions, so 1,024-token prompts fit
    "medium-qwen2": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=1024, max_position_embeddings=4096),
    # the tiny model with Qwen2.5's chat template (tool schemas, <tool_call> parsing by TRL) and one token that is a
    # whole call of the built-in tool, so a random model calls it now and then and RL can make it call it always
    "tiny-qwen2-tools": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, tools=True),
    # the tiny model whose end-of-text token is likelier where its hidden state points the end token's way: most
    # completions end within a few dozen tokens, a few run to max_completion_length (a long tail, as in long
    # chain-of-thought); the policy can learn to end sooner or later (partial-rollout tests and benchmarks)
    "tiny-qwen2-longtail": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=384, eos_scale=EOS_SCALE_LONGTAIL),
    # a vision-language model (Idefics3 architecture: a SigLIP-style vision tower, a pixel-shuffle connector and a
    # Llama text model), 4 image tokens per 56x56 image; vLLM runs it on CPU without torchvision
    "tiny-idefics3": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=384, vlm=True),
    # the same VLM with a tool-calling chat template (images in any message, the tool's included), TRL's response
    # parser for it and one token that is a whole call of the built-in picture tool (:func:`show_picture`)
    "tiny-idefics3-tools": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=384, vlm=True, tools=True),
}

#: The built-in tool's name and the single token that calls it (Qwen2.5's tool-call format).
TOOL_NAME = "lucky_number"
TOOL_CALL_TOKEN = '<tool_call>\n{"name": "lucky_number", "arguments": {}}\n</tool_call>'

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = ["the", "a", "number", "write", "give", "me", "say", "please", "now", "some", "any", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "digits", "only", "answer", "count", "value", "total", "sum", "result", "list", "here", "is", "what", "of", "to", "and", "with", "for", "small", "large", "big", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "model", "reward", "policy", "sample", "group", "token", "step"]
_PROMPT_TEMPLATES = [
    "Write a number:",
    "Give me some digits:",
    "Say a {w} number:",
    "Please answer with digits only. {W} {w}:",
    "What is the total of the {w}?",
    "Count the {w} and answer:",
    "Here is a {w}. Its value is",
    "The {w} {w} result is",
]


def cache_dir() -> Path:
    """Root of the package's cache (``$TRL_NROLLOUT_CACHE`` or ``~/.cache/trl_nrollout``)."""
    return Path(os.environ.get("TRL_NROLLOUT_CACHE", Path.home() / ".cache" / "trl_nrollout"))


def is_builtin(name_or_path: str) -> bool:
    """True for names like ``builtin:tiny-qwen2``."""
    return isinstance(name_or_path, str) and name_or_path.startswith(BUILTIN_PREFIX)


def resolve_model(name_or_path: str) -> str:
    """Turn a ``builtin:`` name into a local folder (building it when needed); anything else is returned as is."""
    if not is_builtin(name_or_path):
        return name_or_path
    name = name_or_path[len(BUILTIN_PREFIX):]
    if name not in BUILTIN_MODELS:
        raise ValueError(
            f"model_name_or_path={name_or_path!r} is not a built-in model; use one of "
            f"{[BUILTIN_PREFIX + k for k in BUILTIN_MODELS]}, a hub id or a local path."
        )
    target = cache_dir() / "models" / f"{name}-{_BUILDERS_VERSION}"
    if not (target / "config.json").exists():
        spec = dict(BUILTIN_MODELS[name])
        build = build_tiny_vlm if spec.pop("vlm", False) else build_tiny_model
        build(target, **spec)
    return str(target)


def _corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = [p.format(w=rng.choice(_WORDS), W=rng.choice(_WORDS).capitalize()) for p in _PROMPT_TEMPLATES * 40]
    lines += [" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(400)]
    lines += [" ".join(str(rng.randint(0, 10**rng.randint(1, 6))) for _ in range(8)) for _ in range(200)]
    lines += ["".join(rng.choice("!?.,;:-+*/=()[]{}#@&%$") for _ in range(10)) for _ in range(50)]
    return lines


def _bpe_tokenizer(vocab_size: int, special_tokens: list[str], corpus: list[str]):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``corpus`` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


@contextlib.contextmanager
def _atomic_folder(target: Path, seed: int):
    """Yield a temporary folder beside ``target``; on success mark it built and rename it into place, so concurrent
    processes never see a half-built model (a process that loses the race uses the winner's copy)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        yield tmp
        (tmp / "trl_nrollout_builtin.json").write_text(json.dumps({"seed": seed, "version": _BUILDERS_VERSION}))
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_tiny_model(target: Path, *, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                     num_attention_heads: int, num_key_value_heads: int, vocab_size: int, seed: int = 0,
                     tools: bool = False, max_position_embeddings: int = 1024, eos_scale: float = 1.0) -> Path:
    """Train a byte-level BPE tokenizer on the built-in corpus and save it with a random Qwen2 model.

    ``tools``: Qwen2.5's chat template (as TRL ships it, so TRL's tool-call parser applies), its tool tokens, the
    tool boilerplate in the tokenizer's corpus (short prompts), and :data:`TOOL_CALL_TOKEN` as one token that also
    ends a turn (an EOS of the generation config, as a real model's ``<|im_end|>`` after a call).

    Writes to a temporary folder and renames it into place, so concurrent processes never see a half-built
    model. Deterministic for a given seed. ``eos_scale``: the end-of-text token's embedding row (tied to the output
    head) times this, so its logit swings widely with the hidden state: a long-tailed completion length.
    """
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    target = Path(target)
    with _atomic_folder(target, seed) as tmp:
        corpus = _corpus(seed)
        if tools:
            corpus += _tool_corpus() * 30
        tok = _bpe_tokenizer(vocab_size, SPECIAL_TOKENS, corpus)
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
            bos_token=None, unk_token=None, additional_special_tokens=["<|im_start|>"],
        )
        hf_tok.chat_template = CHAT_TEMPLATE
        if tools:
            from trl.chat_template_utils import qwen2_5_chat_template

            hf_tok.chat_template = qwen2_5_chat_template
            hf_tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", TOOL_CALL_TOKEN])
        hf_tok.save_pretrained(tmp)

        torch.manual_seed(seed)
        config = Qwen2Config(
            vocab_size=len(hf_tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=True, eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id,
            bos_token_id=None, dtype="float32",
        )
        model = Qwen2ForCausalLM(config)
        if eos_scale != 1.0:
            with torch.no_grad():
                model.get_input_embeddings().weight[hf_tok.eos_token_id] *= eos_scale
        model.generation_config.eos_token_id = hf_tok.eos_token_id
        if tools:  # a call ends the turn, as <|im_end|> after a real model's call
            model.generation_config.eos_token_id = [hf_tok.eos_token_id, hf_tok.convert_tokens_to_ids(TOOL_CALL_TOKEN)]
        model.generation_config.pad_token_id = hf_tok.pad_token_id
        model.save_pretrained(tmp)
    return target


VLM_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                      "<global-img>"]
#: Idefics3-style chat template (images as ``<image>``, which the processor expands).
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}:{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
VLM_IMAGE_SIZE = 56
#: The built-in picture tool's name and the single token that calls it (the tool-calling VLM's format).
PICTURE_TOOL = "show_picture"
PICTURE_CALL_TOKEN = '<tool_call>\n{"name": "show_picture", "arguments": {}}\n</tool_call>'
#: The tool-calling VLM's template: prefix-preserving (TRL's multi-turn rule), tool schemas in a system turn, calls as
#: ``<tool_call>`` JSON, images (``<image>``) in any message's content blocks, a tool's result included.
VLM_TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}system:{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<end_of_utterance>\n{% endif %}"
    "{% for message in messages %}{{ message['role'] }}:{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}<tool_call>\n{\"name\": \""
    "{{ call['function']['name'] }}\", \"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
#: transformers' response parser for that template (TRL's Qwen3 one, with this template's turn markers).
VLM_TOOLS_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "assistant:",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<end_of_utterance>\s*", "content": "text"},
    },
}


def build_tiny_vlm(target: Path, *, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                   num_attention_heads: int, num_key_value_heads: int, vocab_size: int, seed: int = 0,
                   tools: bool = False) -> Path:
    """A random Idefics3 vision-language model with its processor (tokenizer trained on the built-in corpus,
    56x56 images without splitting, 4 image tokens each) saved to ``target``; written atomically like
    :func:`build_tiny_model`. The vision tower is half the text model's width, two layers, patch size 14.
    ``tools``: :data:`VLM_TOOLS_CHAT_TEMPLATE`, its response parser, and :data:`PICTURE_CALL_TOKEN` as one token that
    also ends a turn."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    target = Path(target)
    with _atomic_folder(target, seed) as tmp:
        tok = _bpe_tokenizer(vocab_size, VLM_SPECIAL_TOKENS, _corpus(seed))
        hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<end_of_utterance>", pad_token="<|endoftext|>",
                                         bos_token="<|im_start|>", unk_token=None,
                                         additional_special_tokens=VLM_SPECIAL_TOKENS[2:])
        template = VLM_TOOLS_CHAT_TEMPLATE if tools else VLM_CHAT_TEMPLATE
        hf_tok.chat_template = template
        if tools:
            hf_tok.add_tokens(["<tool_call>", "</tool_call>", PICTURE_CALL_TOKEN])
            hf_tok.response_template = VLM_TOOLS_RESPONSE_TEMPLATE
        side = {"longest_edge": VLM_IMAGE_SIZE}
        images = Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side)
        patch, scale = 14, 2
        seq_len = (VLM_IMAGE_SIZE // patch) ** 2 // scale**2
        processor = Idefics3Processor(image_processor=images, tokenizer=hf_tok, image_seq_len=seq_len,
                                      chat_template=template)
        processor.save_pretrained(tmp)
        ids = {t: hf_tok.convert_tokens_to_ids(t) for t in VLM_SPECIAL_TOKENS}
        eos, pad = ids["<end_of_utterance>"], ids["<|endoftext|>"]
        torch.manual_seed(seed)
        config = Idefics3Config(
            vision_config=dict(hidden_size=hidden_size // 2, intermediate_size=intermediate_size // 2,
                               num_hidden_layers=2, num_attention_heads=num_attention_heads,
                               image_size=VLM_IMAGE_SIZE, patch_size=patch),
            text_config=dict(model_type="llama", vocab_size=len(hf_tok), hidden_size=hidden_size,
                             intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
                             num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                             max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=eos,
                             pad_token_id=pad, bos_token_id=ids["<|im_start|>"]),
            image_token_id=ids["<image>"], scale_factor=scale, tie_word_embeddings=True, pad_token_id=pad,
            dtype="float32")
        model = Idefics3ForConditionalGeneration(config)
        model.generation_config.eos_token_id = eos
        if tools:  # a call ends the turn
            model.generation_config.eos_token_id = [eos, hf_tok.convert_tokens_to_ids(PICTURE_CALL_TOKEN)]
        model.generation_config.pad_token_id = pad
        model.save_pretrained(tmp)
    return target


def _tool_corpus() -> list[str]:
    """The texts Qwen2.5's template renders around the built-in tool (so the tokenizer keeps prompts short)."""
    from transformers.utils import get_json_schema

    schema = json.dumps({"type": "function", "function": get_json_schema(lucky_number)["function"]})
    return [
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
        "# Tools", "You may call one or more functions to assist with the user query.",
        "You are provided with function signatures within <tools></tools> XML tags:", schema,
        "For each function call, return a json object with function name and arguments within <tool_call>"
        "</tool_call> XML tags:", '{"name": <function-name>, "arguments": <args-json-object>}',
        "system user assistant tool <tool_response> </tool_response>",
    ]


# ---------------------------------------------------------------------------------------------- task
def digits_prompts(num: int = 256, seed: int = 0) -> list[str]:
    """``num`` synthetic prompts of the ``digits`` task (deterministic for a seed)."""
    rng = random.Random(seed)
    return [
        rng.choice(_PROMPT_TEMPLATES).format(w=rng.choice(_WORDS), W=rng.choice(_WORDS).capitalize())
        for _ in range(num)
    ]


def long_prompts(texts: list[str], tokenizer, prompt_tokens: int, seed: int = 0) -> list[str]:
    """``texts`` made ``prompt_tokens`` tokens long (never over, short by less than one word) by a context of random
    words before each one, as real prompts carry instructions and few-shot examples before the question.

    Each prompt gets its own context (deterministic for ``seed``), so no two prompts share a prefix beyond what the
    engine's prefix cache would see in real data. A text already that long is kept as it is. ``tokenizer``: the
    model's (the length is counted without special tokens or a chat template)."""
    rng = random.Random(seed)
    out = []
    for text in texts:
        words = [rng.choice(_WORDS) for _ in range(prompt_tokens)]  # a word is at least one token: enough words

        def length(k: int, words: list[str] = words, text: str = text) -> int:
            return len(tokenizer(" ".join(words[:k]) + "\n" + text, add_special_tokens=False)["input_ids"])

        lo, hi = 0, len(words)  # the most words whose prompt still fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if length(mid) <= prompt_tokens else (lo, mid - 1)
        out.append(" ".join(words[:lo]) + "\n" + text if lo else text)
    return out


def digits_dataset(num: int = 256, seed: int = 0):
    """The built-in prompt set as a ``datasets.Dataset`` with a ``prompt`` column (plain text)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": digits_prompts(num, seed)})


def digit_fraction(text: str) -> float:
    """Fraction of the non-space characters of ``text`` that are ASCII digits; 0.0 for an empty text."""
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c in "0123456789" for c in chars) / len(chars)


def digits_reward(completions: list, **kwargs) -> list[float]:
    """TRL-style reward function of the ``digits`` task: :func:`digit_fraction` of each completion.

    Accepts plain-text completions or conversational ones (a list of messages; the last one is scored).
    """
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(digit_fraction(text))
    return out


#: Completion tokens (its end-of-text token included) within which a ``short_answer`` ends.
SHORT_ANSWER_TOKENS = 8


def short_answer_reward(completions: list, completion_ids: list, **kwargs) -> list[float]:
    """1.0 for each completion with some text in at most :data:`SHORT_ANSWER_TOKENS` tokens, else 0.0: with
    ``max_completion_length`` above that, only an answer that ends (the model's end-of-text token) gets it, and one
    cut at ``max_completion_length`` never does. The embedded default weighs it with ``digits`` (0.5 each), so the
    policy learns to answer with digits and stop, instead of writing digits until it is truncated.

    ``completion_ids``: the completions' token ids (TRL passes them to every reward function)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(0 < len(ids) <= SHORT_ANSWER_TOKENS and bool(text.strip()))
            for text, ids in zip(texts, completion_ids, strict=True)]


# ---------------------------------------------------------------------------------------------- tool task
def lucky_number() -> str:
    """Returns today's lucky number.

    Returns:
        The lucky number, as digits.
    """
    return "7"


class _AsyncTools:
    @staticmethod
    async def lucky_number() -> str:
        """Returns today's lucky number.

        Returns:
            The lucky number, as digits.
        """
        return "7"


#: The built-in tool as an async function (it could await a service); the same name and schema as the sync one.
lucky_number_async = _AsyncTools.lucky_number


def tool_dataset(num: int = 256, seed: int = 0):
    """The ``digits`` prompts as conversations (TRL's tools need chat prompts)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in digits_prompts(num, seed)]})


def tool_reward(completions: list, **kwargs) -> list[float]:
    """Reward of the built-in tool task: 1.0 when the sample called a tool and got a result (no error), else 0.0.

    ``completions`` are TRL's multi-turn messages (assistant turns and tool results)."""
    out = []
    for messages in completions:
        results = [m for m in messages if isinstance(m, dict) and m.get("role") == "tool"]
        out.append(1.0 if any("error" not in str(m.get("content")) for m in results) else 0.0)
    return out


# ---------------------------------------------------------------------------------------------- image task
#: The colours of the image task and what each asks for.
IMAGE_COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}


def colour_image(colour: str, seed: int = 0):
    """A ``VLM_IMAGE_SIZE`` square PIL image of one colour with a little noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = np.array(IMAGE_COLOURS[colour], dtype=np.float32)
    pixels = base + rng.normal(0, 12, size=(VLM_IMAGE_SIZE, VLM_IMAGE_SIZE, 3))
    return Image.fromarray(pixels.clip(0, 255).astype("uint8"))


def show_picture() -> list:
    """Shows the picture to describe.

    Returns:
        The picture and a caption.
    """
    global _pictures_shown
    _pictures_shown += 1
    colour = sorted(IMAGE_COLOURS)[_pictures_shown % len(IMAGE_COLOURS)]
    return [{"type": "image", "image": colour_image(colour, seed=_pictures_shown)}, {"type": "text", "text": "here"}]


_pictures_shown = 0  # (calls so far: each call shows the next picture, red and blue in turn)


def image_dataset(num: int = 256, seed: int = 0):
    """The image task: conversational ``digits`` prompts, each with an ``image`` column holding a red or a blue
    picture (TRL's format: the trainer puts the image before the prompt's text) and its ``colour``."""
    from datasets import Dataset

    rng = random.Random(seed)
    colours = [rng.choice(sorted(IMAGE_COLOURS)) for _ in range(num)]
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": p}] for p in digits_prompts(num, seed)],
        "image": [colour_image(c, seed + i) for i, c in enumerate(colours)],
        "colour": colours,
    })


def colour_reward(completions: list, colour: list[str], **kwargs) -> list[float]:
    """Reward of the image task: on a red picture the fraction of digits, on a blue one the fraction of other
    characters (0 for an empty completion). Ignoring the picture caps the expected reward at about 0.5."""
    out = []
    for c, col in zip(completions, colour, strict=True):
        text = c[-1]["content"] if isinstance(c, list) else c
        chars = [ch for ch in text if not ch.isspace()]
        digits = digit_fraction(text)
        out.append(digits if col == "red" else (1.0 - digits if chars else 0.0))
    return out
