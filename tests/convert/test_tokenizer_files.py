"""The byte tokenizer written as real tokenizer files (convert/tokenizer_files.py) that transformers loads."""

from __future__ import annotations


def test_the_byte_tokenizer_exports_as_a_real_tokenizer(tmp_path):
    """The byte tokenizer written as tokenizer files: AutoTokenizer encodes and renders chats (tool calls included)
    exactly as training did."""
    from transformers import AutoTokenizer

    from glm53_ds.convert.tokenizer_files import write_byte_tokenizer
    from glm53_ds.training.data import ByteTokenizer

    write_byte_tokenizer(str(tmp_path))
    tok, ours = AutoTokenizer.from_pretrained(tmp_path), ByteTokenizer()
    text = "héllo wörld \n\t 🙂 <|user|>"
    assert tok.encode(text, add_special_tokens=False) == ours.encode(text)
    assert (len(tok), tok.eos_token_id, tok.pad_token_id) == (258, ours.eod_id, ours.pad_id)
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "sunny"}]  # fmt: skip
    for head in (messages[:2], messages):
        for prompt in (False, True):
            rendered = tok.apply_chat_template(
                head, tokenize=True, add_generation_prompt=prompt, return_dict=False
            )
            assert list(rendered) == ours.chat_template_ids(head, add_generation_prompt=prompt)
