"""The tokenizer files an export carries, and the byte tokenizer as a real `transformers` tokenizer.

An export is a directory `AutoTokenizer.from_pretrained` loads: the run's own tokenizer files are copied
(`TOKENIZER_FILES`, from --hf-dir or --tokenizer DIR), or, for the byte tokenizer (the tiny preset's vocabulary),
`write_byte_tokenizer` writes one that encodes and renders chats exactly as `training.data.ByteTokenizer` does:
ids 0-255 are the UTF-8 bytes, 256 `<|endoftext|>` (end of document, the eos), 257 `<|pad|>`, and the chat template
is the built-in one (`<|role|>\\n{content}\\n` per message, `<|assistant|>\\n` as the generation prompt).
"""

from __future__ import annotations

import json
import os

# The files of a tokenizer directory that decide its token ids and chat rendering.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")  # fmt: skip
BYTE_EOD_TOKEN, BYTE_PAD_TOKEN = "<|endoftext|>", "<|pad|>"
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call | tojson }}</tool_call>{% endfor %}"
    "{{ '\\n' }}{% endfor %}"  # an expression: transformers renders with trim_blocks
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what a byte-level BPE vocabulary is written in)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tokenizer_json_for_bytes() -> dict:
    """A `tokenizers` byte-level BPE without merges: every byte is one token whose id is the byte's value."""
    vocab = {c: b for b, c in _byte_to_unicode().items()}
    special = [(BYTE_EOD_TOKEN, 256), (BYTE_PAD_TOKEN, 257)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            dict(
                id=i, content=t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True
            )
            for t, i in special
        ],  # fmt: skip
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },  # fmt: skip
    }


def write_byte_tokenizer(directory: str) -> None:
    """The byte tokenizer as tokenizer files (module docstring) in `directory`."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_json_for_bytes(), f, ensure_ascii=False)
    config = dict(tokenizer_class="PreTrainedTokenizerFast", eos_token=BYTE_EOD_TOKEN, pad_token=BYTE_PAD_TOKEN,
                  model_max_length=1 << 30, clean_up_tokenization_spaces=False)  # fmt: skip
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(directory, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(BYTE_CHAT_TEMPLATE)
