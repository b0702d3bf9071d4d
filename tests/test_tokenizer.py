"""Our tokenizer wrapper and chat-template rendering agree with transformers on the same files."""

from __future__ import annotations


def test_encode_decode_and_chat_template_match_transformers(default_model, default_model_dir):
    from transformers import AutoTokenizer

    ours = default_model.tokenizer
    theirs = AutoTokenizer.from_pretrained(str(default_model_dir))
    for text in ["def add(a, b):\n    return a + b\n", "Ünïcödé — ✓ 日本語", "  leading spaces\tand tabs"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text)) == text
    for messages in ([{"role": "user", "content": "Hi there"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]):
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == expected
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2
