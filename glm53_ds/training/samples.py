"""Samples while training (`--sample-prompts FILE`, `--sample-interval N`, `--sample-tokens M`).

The prompts are read once at start-up, before any expensive work (a bad line is one error naming `file:line`):
a `.jsonl` of `{"prompt": ...}` or `{"messages": [...]}` (the chat shapes of training/packing.py), or any other file
with one prompt per non-empty line. For chat data (or a `messages` line) a prompt goes through the tokenizer's chat
template with the generation prompt, as the model will be asked at inference; otherwise its text is the prefix.

Generation is greedy (argmax: no random numbers are drawn) and at most M new tokens, stopping at the end-of-document
token or at the model's positions (a prompt longer than they leave room for keeps its last tokens, said once at
start-up: `fit_prompts`); the model runs in eval mode without gradients, which leaves the router's load counts alone, and the CPU /
CUDA RNG states are restored afterwards, so a run with samples trains bitwise as one without (tested). Every rank
runs the same prompts in step, since the MoE's expert-parallel dispatch is collective. Refused under SP: a rank
there holds a shard of the row's logits.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from .packing import chat_messages


@dataclass(frozen=True)
class Prompt:
    text: str  # as the sample record shows it (a conversation: its last user turn)
    ids: list[int]


def read_prompts(path: str, tokenizer: Any, chat: bool) -> list[Prompt]:
    """The prompts of `path` as token ids (module docstring); a ValueError names the file and line."""
    if not os.path.isfile(path):
        raise ValueError(f"--sample-prompts {path!r}: no such file")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            where = f"--sample-prompts {path}:{number}"
            if not line.strip():
                continue
            messages: list[dict[str, Any]] | None = None
            if path.endswith(".jsonl"):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not a JSON line ({e.msg})") from e
                if isinstance(record, dict) and "messages" in record:
                    messages = chat_messages(record, where)
                elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
                    text = record["prompt"]
                else:
                    raise ValueError(f"{where}: a prompt line needs 'prompt' (a string) or 'messages'")
            else:
                text = line.rstrip("\n")
            if messages is None and chat:
                messages = [{"role": "user", "content": text}]
            if messages is not None:
                template = getattr(tokenizer, "chat_template_ids", None)
                if template is None:
                    raise ValueError(f"{where}: a conversation, and the tokenizer has no chat template")
                ids = list(template(messages, add_generation_prompt=True))
                text = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
            else:
                ids = tokenizer.encode(text)
            if not ids:
                raise ValueError(f"{where}: the prompt has no tokens")
            prompts.append(Prompt(text, ids))
    if not prompts:
        raise ValueError(f"--sample-prompts {path!r}: no prompts in it")
    return prompts


def fit_prompts(prompts: list[Prompt], positions: int, new_tokens: int) -> tuple[list[Prompt], str | None]:
    """Prompts that leave room for `new_tokens` within the model's `positions`: a longer one keeps its last tokens
    (what the model is asked to continue); the line saying so, or None."""
    room = positions - new_tokens if positions > new_tokens else max(1, positions // 2)
    long = [p for p in prompts if len(p.ids) > room]
    if not long:
        return prompts, None
    fitted = [Prompt(p.text, p.ids[-room:]) if len(p.ids) > room else p for p in prompts]
    return fitted, (f"--sample-prompts: {len(long)} prompt(s) longer than the model's {positions} positions less "
                    f"--sample-tokens {new_tokens} (the longest {max(len(p.ids) for p in long)} tokens): each keeps "
                    f"its last {room} tokens")  # fmt: skip


def greedy(
    model: torch.nn.Module,
    ids: list[int],
    max_new: int,
    stop: int | None,
    device: Any,
    positions: int | None = None,
) -> list[int]:
    """Up to `max_new` tokens after `ids`, each the argmax of the model's last logits (the whole prefix rerun: the
    model keeps no cache), stopping before `stop` or at the model's `positions`."""
    out = list(ids)
    if positions is not None:
        max_new = min(max_new, max(positions - len(out), 0))
    for _ in range(max_new):
        logits = model(torch.tensor([out], dtype=torch.long, device=device))  # [1, s, V]
        token = int(logits[0, -1].argmax())
        if token == stop:
            break
        out.append(token)
    return out[len(ids) :]


def generate_samples(
    model: torch.nn.Module, prompts: list[Prompt], tokenizer: Any, max_new: int, device: Any,
    positions: int | None = None,
) -> list[dict[str, str]]:  # fmt: skip
    """Each prompt's greedy completion (module docstring); the model's mode and the RNG states as they were."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return [
                {"prompt": p.text,
                 "completion": tokenizer.decode(greedy(model, p.ids, max_new, tokenizer.eod_id, device, positions))}
                for p in prompts
            ]  # fmt: skip
    finally:
        model.train(was_training)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
