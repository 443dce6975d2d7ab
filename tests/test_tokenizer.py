"""Tokenizer (HF dir and GGUF), chat templates, and streaming detokenization with stop strings."""

from __future__ import annotations

import pytest

from meshserve.shared.tokenizer import IncrementalDetokenizer, Tokenizer
from tiny_model import write_tiny_gguf

SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "digits 0123456789 and 3.14159, 1,000,000 or 42%",
    "  leading spaces",
    "trailing spaces   ",
    "    ",
    "line1\nline2\r\n\r\nline3\n\n\n",
    "\ttab\tseparated\tvalues",
    "héllo wörld 日本語 🙂",
    "emoji 👍🏽 👨‍👩‍👧 ✨",
    "Café naïve résumé Straße ÀÉÎõü ßæø",
    "Привет, мир! ¿Qué tal?",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    'json: {"a": [1, 2], "b": null}',
    "I'm sure they'll say it's fine, don't you think?",
    "https://example.com/a?b=1&c=2",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]

CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? 🙂"},
]

MULTIBYTE = "héllo wörld 日本語 🙂"


@pytest.fixture(scope="module")
def tiny_tok(tiny_llama) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_llama)


# ---------------------------------------------------------------- tiny tokenizer


def test_tiny_tokenizer_matches_transformers(tiny_llama, tiny_tok):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_llama)
    assert tiny_tok.vocab_size == 384
    assert (tiny_tok.bos_token_id, tiny_tok.eos_token_id, tiny_tok.eos_token_ids) == (1, 2, [2])
    for s in SAMPLES:
        ids = tiny_tok.encode(s)
        assert ids == ref.encode(s), s
        plain = s.replace("<|im_start|>", "").replace("<|im_end|>", "")
        assert tiny_tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == plain
    for agp in (True, False):
        assert tiny_tok.apply_chat_template(CONVERSATION, add_generation_prompt=agp) == ref.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=agp)


def test_from_hf_dir_reads_transformers_saved_tokenizer(tiny_llama, tiny_tok, tmp_path):
    """Transformers (>= 4.50) saves the template as chat_template.jinja, special tokens as dicts."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.chat_template == tiny_tok.chat_template
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 2, False)
    assert tok.encode(MULTIBYTE) == tiny_tok.encode(MULTIBYTE)


def test_tiny_gguf_tokenizer_equals_hf(tiny_llama, tiny_tok, tmp_path):
    g = Tokenizer.from_gguf(write_tiny_gguf(tiny_llama, tmp_path / "t.gguf"))
    assert g.vocab_size == tiny_tok.vocab_size
    assert (g.bos_token_id, g.eos_token_id, g.eos_token_ids) == (1, 2, [2])
    for s in SAMPLES:
        assert g.encode(s) == tiny_tok.encode(s), s
        assert g.decode(g.encode(s), skip_special_tokens=False) == s
    assert g.apply_chat_template(CONVERSATION) == tiny_tok.apply_chat_template(CONVERSATION)


def test_chat_template_features(tiny_llama, tiny_tok):
    """The jinja environment Transformers gives templates: tojson without HTML escaping,
    raise_exception, loop controls, trim_blocks/lstrip_blocks, special-token variables,
    tools, and message keys that are None dropped."""
    import jinja2
    from transformers import AutoTokenizer

    tmpl = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}\n"
        "  {% if m['role'] == 'skip' %}{% continue %}{% endif %}\n"
        "{{ m['role'] }}:{% if m['content'] is defined %} {{ m['content'] | tojson }}{% endif %}\n"
        "{% endfor %}{% if tools %}{{ tools | tojson(indent=1) }}{% endif %}"
        "{% if add_generation_prompt %}>{% endif %}{{ eos_token }}"
    )
    msgs = [{"role": "user", "content": "<b>&'é"}, {"role": "skip", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}]
    tools = [{"name": "f", "parameters": {"type": "object"}}]
    tok = Tokenizer.from_hf_dir(tiny_llama)
    tok.chat_template = tmpl
    out = tok.apply_chat_template(msgs, tools=tools)
    assert out.startswith('<|im_start|>user: "<b>&\'é"assistant:[') and out.endswith("]><|im_end|>")
    ref = AutoTokenizer.from_pretrained(tiny_llama)
    assert out == ref.apply_chat_template(msgs, chat_template=tmpl, tools=tools, tokenize=False,
                                          add_generation_prompt=True)
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])
    with pytest.raises(ValueError):
        Tokenizer(tiny_tok.tk).apply_chat_template(msgs)


# --------------------------------------------------------------- detokenizer


@pytest.mark.parametrize("use_stream", [True, False], ids=["DecodeStream", "prefix-offset"])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_incremental_detokenizer_multibyte(tiny_tok, use_stream, chunk):
    for s in [MULTIBYTE, "日本語🙂🙂 ok", "Café naïve 👨‍👩‍👧", "plain ascii text"]:
        ids = tiny_tok.encode(s)
        # the tiny vocabulary has no merges for CJK/emoji: those characters span several tokens
        if s == MULTIBYTE:
            assert len(ids) > len(s.split()) + 10
        det = IncrementalDetokenizer(tiny_tok, use_decode_stream=use_stream)
        deltas = [det.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
        deltas.append(det.flush())
        assert "".join(deltas) == tiny_tok.decode(ids) == s
        assert not any("\ufffd" in d for d in deltas)
        assert det.text == s and not det.stopped


def test_detokenizer_skips_special_tokens(tiny_tok):
    ids = tiny_tok.encode("<|im_start|>assistant\nhi there<|im_end|>")
    det = IncrementalDetokenizer(tiny_tok)
    assert det.add(ids) + det.flush() == "assistant\nhi there"


def test_detokenizer_incomplete_utf8_at_end(tiny_tok):
    ids = tiny_tok.encode("ok 🙂")
    det = IncrementalDetokenizer(tiny_tok)
    out = det.add(ids[:-1])  # the emoji's last byte never arrives
    assert out == "ok "
    assert det.flush() == tiny_tok.decode(ids[:-1])[len("ok "):]  # replacement char(s), not silence


def _stream(tok: Tokenizer, text: str, stop: list[str], chunk: int = 1):
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, stop=stop)
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(det.add(ids[i:i + chunk]))
        emitted = "".join(deltas)
        # nothing emitted may be (the start of) a stop string that is still possible
        assert not any(s in emitted for s in stop)
        if not det.stopped:
            assert not any(emitted.endswith(s[:k]) for s in stop for k in range(1, len(s)))
    deltas.append(det.flush())
    return det, deltas


@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_string_truncates(tiny_tok, chunk):
    det, deltas = _stream(tiny_tok, "Hello world! The end.", ["world"], chunk)
    assert "".join(deltas) == "Hello " == det.text
    assert det.stopped and det.matched_stop == "world"
    assert det.add(tiny_tok.encode(" more")) == "" and det.flush() == ""


def test_stop_string_earliest_match_wins(tiny_tok):
    det, deltas = _stream(tiny_tok, "one two three four", ["four", "two t"])
    assert "".join(deltas) == "one " and det.matched_stop == "two t"


def test_stop_string_in_multibyte_text(tiny_tok):
    det, deltas = _stream(tiny_tok, "abc 日本語 def", ["本語"])
    assert "".join(deltas) == "abc 日" and det.matched_stop == "本語"


def test_stop_string_at_start_and_newline(tiny_tok):
    det, deltas = _stream(tiny_tok, "Hello there", ["Hel"])
    assert "".join(deltas) == "" and det.stopped
    det, deltas = _stream(tiny_tok, "first line\n\nsecond", ["\n\n"])
    assert "".join(deltas) == "first line" and det.matched_stop == "\n\n"


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_kept_with_include_stop_str_in_output(tiny_tok, chunk):
    ids = tiny_tok.encode("Hello world! The end.")
    det = IncrementalDetokenizer(tiny_tok, stop=["world", "end"], include_stop_str_in_output=True)
    out = "".join(det.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)) + det.flush()
    assert out == "Hello world" == det.text and det.matched_stop == "world"


def test_partial_stop_is_held_back_then_flushed(tiny_tok):
    ids = tiny_tok.encode("Hello wo")
    det = IncrementalDetokenizer(tiny_tok, stop=["world", "xyz"])
    assert det.add(ids) == "Hello "  # "wo" could still become "world"
    assert det.text == "Hello wo" and not det.stopped
    assert det.flush() == "wo"


def test_partial_stop_released_when_it_diverges(tiny_tok):
    det, deltas = _stream(tiny_tok, "Hello wonderful world", ["world"])
    assert "".join(deltas) == "Hello wonderful " and det.stopped
    det, deltas = _stream(tiny_tok, "Hello wonderful day", ["world"])
    assert "".join(deltas) == "Hello wonderful day" and not det.stopped and det.matched_stop is None


# ------------------------------------------------------------- default model


@pytest.fixture(scope="module")
def smol(default_model_file):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    ours = Tokenizer.from_gguf(default_model_file)
    ref = AutoTokenizer.from_pretrained(default_model_file.parent, gguf_file=default_model_file.name)
    return ours, ref


def test_default_model_tokenizer_matches_transformers(smol):
    ours, ref = smol
    assert ours.vocab_size == 49152 == len(ref)
    assert (ours.bos_token_id, ours.eos_token_id, ours.eos_token_ids) == (1, 2, [2])
    assert not ours.add_bos_token
    for s in SAMPLES:
        ids = ours.encode(s)
        assert ids == ref.encode(s), s
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), s
        assert ours.decode(ids, skip_special_tokens=False) == s


def test_default_model_digits_after_spaces(smol):
    """Known, deliberate difference from Transformers' GGUF tokenizer: SmolLM2's own
    tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split every digit off
    *before* the GPT-2 regex, so "a  1" is a|ĠĠ|1.  Transformers' GGUF path builds a
    plain GPT-2 ByteLevel pre-tokenizer (no Digits step) and yields a|Ġ|Ġ|1.  We follow
    the model's original tokenizer, since that is what it was trained on."""
    ours, ref = smol
    toks = lambda ids: ref.convert_ids_to_tokens(ids)  # noqa: E731
    assert toks(ours.encode("a  1")) == ["a", "ĠĠ", "1"]
    assert toks(ref.encode("a  1")) == ["a", "Ġ", "Ġ", "1"]
    assert toks(ours.encode("x 12")) == toks(ref.encode("x 12")) == ["x", "Ġ", "1", "2"]


def test_default_model_chat_template_matches_transformers(smol):
    ours, ref = smol
    two_turn = CONVERSATION[:2]
    for conv in (two_turn, [{"role": "system", "content": "Be brief."}] + CONVERSATION):
        for agp in (True, False):
            expected = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=agp)
            assert ours.apply_chat_template(conv, add_generation_prompt=agp) == expected
    prompt = ours.apply_chat_template(two_turn)
    assert ours.encode(prompt, add_special_tokens=False) == ref.apply_chat_template(
        two_turn, tokenize=True, add_generation_prompt=True, return_dict=False)


def test_default_model_streaming(smol):
    ours, _ = smol
    text = "Sure! 日本語 means Japanese 🙂.\n<|im_end|>"
    ids = ours.encode(text)
    det = IncrementalDetokenizer(ours, stop=["Japanese"])
    out = "".join(det.add(i) for i in ids) + det.flush()
    assert out == "Sure! 日本語 means " and det.matched_stop == "Japanese"


def test_a_messages_own_keys_reach_the_chat_template():
    """As Transformers passes message dicts whole: a template may read keys OpenAI does not define."""
    from meshserve.shared.openai_protocol import parse_request
    from meshserve.shared.tokenizer import render_chat_template

    req = parse_request("chat", {"messages": [{"role": "assistant", "content": "4", "reasoning_content": "2+2"}]})
    msgs = req.template_messages()
    assert msgs == [{"role": "assistant", "content": "4", "reasoning_content": "2+2"}]
    template = "{% for m in messages %}<think>{{ m.reasoning_content }}</think>{{ m.content }}{% endfor %}"
    assert render_chat_template(template, msgs, add_generation_prompt=False) == "<think>2+2</think>4"


def test_chat_request_template_options_render_as_transformers(tiny_llama):
    """vLLM's continue_final_message, chat_template and chat_template_kwargs, against Transformers'
    apply_chat_template on the same tokenizer."""
    from transformers import AutoTokenizer

    from meshserve.shared.limits import RequestLimits
    from meshserve.shared.openai_protocol import OpenAIError, parse_request

    hf, tok = AutoTokenizer.from_pretrained(str(tiny_llama)), Tokenizer.from_hf_dir(tiny_llama)
    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is "}]
    req = parse_request("chat", {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True})
    want = hf.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert req.render(tok) == want and want.endswith("assistant\nThe color is ")  # no end of turn
    custom = "{% for m in messages %}[{{ m.role }}|{{ greeting }}]{{ m.content }}{% endfor %}"
    body = {"messages": msgs[:1], "chat_template": custom, "chat_template_kwargs": {"greeting": "hi"}}
    with pytest.raises(OpenAIError, match="--trust-request-chat-template"):  # a gateway's default
        parse_request("chat", body)
    req = parse_request("chat", body, limits=RequestLimits(trust_request_chat_template=True))
    assert req.render(tok) == hf.apply_chat_template(msgs[:1], tokenize=False, chat_template=custom, greeting="hi",
                                                     add_generation_prompt=True) == "[user|hi]Name a color."
