"""Tokenizer, chat templates and streaming detokenization.

Wraps a ``tokenizers.Tokenizer`` (Rust, fast) so that the serving path does not
depend on Transformers.  It can be built from a Hugging Face model directory
(tokenizer.json) or from the tokenizer embedded in a GGUF file's metadata, and
renders chat templates with jinja2 the same way Transformers does, so prompts
are byte-identical to what the model was trained on.

``IncrementalDetokenizer`` turns a stream of generated token ids into text
deltas that never split a UTF-8 character and never leak (part of) a stop string.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer

log = logging.getLogger(__name__)

__all__ = ["Tokenizer", "IncrementalDetokenizer", "render_chat_template"]


# ------------------------------------------------------------ chat templates


@lru_cache(maxsize=16)
def _compile_template(source: str):
    """Compile like transformers.utils.chat_template_utils: an immutable sandbox,
    trim_blocks + lstrip_blocks, loopcontrols, a non-HTML-escaping ``tojson``,
    ``raise_exception`` and ``strftime_now``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types (pydantic models -> dicts), as
    Transformers does, and drop message keys whose value is None (OpenAI clients
    send ``content: null`` with tool calls; templates handle a missing key better)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=64)
def template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads (those it does not set itself)."""
    import jinja2.meta

    env = _compile_template(source).environment
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


def render_chat_template(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                         tools: list[dict] | None = None, documents: list[dict] | None = None,
                         **variables: Any) -> str:
    """Render a Hugging Face chat template (jinja2) the way ``apply_chat_template(tokenize=False)`` does."""
    msgs = [{k: v for k, v in m.items() if v is not None} for m in _plain(list(messages))]
    return _compile_template(template).render(
        messages=msgs,
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **_plain(variables),
    )


# ------------------------------------------------------------------ tokenizer


def _token_str(tok: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as a serialized AddedToken dict."""
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


# Byte-level BPE pre-tokenizer splits, keyed by llama.cpp's ``tokenizer.ggml.pre``.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "pixtral": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# StarCoder-family vocabularies (SmolLM, SmolLM2, StarCoder, Refact) put every digit
# in its own pre-token before the GPT-2 regex: HF tokenizer.json has
# Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)], llama.cpp "\p{N}" + gpt2 regex.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact"}


def _byte_level_pre_tokenizer(pre: str | None):
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre not in (None, "default", "gpt2", "gpt-2"):
        log.warning("unknown tokenizer.ggml.pre %r; using the GPT-2 byte-level split", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the bits of tokenizer_config the server needs:
    special tokens, whether to prepend BOS, and the chat template."""

    def __init__(self, tokenizer: _RustTokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None,
                 add_bos_token: bool = False, add_eos_token: bool = False,
                 extra_eos_token_ids: Iterable[int] = ()):
        self.tk = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.bos_token_id = self.token_to_id(bos_token)
        self.eos_token_id = self.token_to_id(eos_token)
        ids = [] if self.eos_token_id is None else [self.eos_token_id]
        for i in extra_eos_token_ids:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
        self.eos_token_ids: list[int] = ids

    # -- construction

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja / special_tokens_map.json /
        generation_config.json when present) of a Hugging Face model directory."""
        path = Path(path)
        tk = _RustTokenizer.from_file(str(path / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later files win
            if (path / name).is_file():
                cfg.update(json.loads((path / name).read_text(encoding="utf-8")))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (path / "chat_template.jinja").is_file():  # Transformers >= 4.50 saves it separately
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif (path / "chat_template.json").is_file():
            data = json.loads((path / "chat_template.json").read_text(encoding="utf-8"))
            template = data.get("chat_template", template)
        extra_eos: list[int] = []
        if (path / "generation_config.json").is_file():
            eos = json.loads((path / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
            extra_eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            tk,
            chat_template=template,
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            pad_token=_token_str(cfg.get("pad_token")),
            unk_token=_token_str(cfg.get("unk_token")),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            add_eos_token=bool(cfg.get("add_eos_token", False)),
            extra_eos_token_ids=extra_eos,
        )

    @classmethod
    def from_gguf(cls, path: str | Path, reader: Any = None) -> "Tokenizer":
        """Rebuild the tokenizer stored in a GGUF file's ``tokenizer.ggml.*`` metadata.

        Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``: GPT-2, SmolLM,
        Llama 3, Qwen2, ...) is supported.  The pre-tokenizer is chosen from
        ``tokenizer.ggml.pre`` to match the original Hugging Face tokenizer.json.
        """
        import gguf

        reader = reader or gguf.GGUFReader(str(path))
        fields = reader.fields

        def get(key: str, default: Any = None) -> Any:
            f = fields.get(key)
            return default if f is None else f.contents()

        kind = get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise NotImplementedError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
        tokens: list[str] = get("tokenizer.ggml.tokens")
        types: list[int] = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]

        # Normal tokens are spelled in the byte-level alphabet; a normal token that is not
        # (rare, a converter quirk) is respelled so that BPE can produce it.
        # Control (3) and user-defined (4) tokens keep their literal text and become added tokens.
        b2u = _bytes_to_unicode()
        alphabet = set(b2u.values())
        vocab: dict[str, int] = {}
        added: list[AddedToken] = []
        for i, (tok, typ) in enumerate(zip(tokens, types)):
            if typ in (3, 4):
                added.append(AddedToken(tok, special=(typ == 3), normalized=False))
            elif not set(tok) <= alphabet:
                tok = "".join(b2u[b] for b in tok.encode("utf-8"))
            vocab.setdefault(tok, i)
        tk = _RustTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tk.pre_tokenizer = _byte_level_pre_tokenizer(get("tokenizer.ggml.pre"))
        tk.decoder = decoders.ByteLevel()
        # add_tokens keeps the ids already in the vocabulary.
        tk.add_special_tokens([a for a in added if a.special])
        tk.add_tokens([a for a in added if not a.special])

        def tok_of(key: str) -> str | None:
            i = get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        extra_eos = [get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
        return cls(
            tk,
            chat_template=get("tokenizer.chat_template"),
            bos_token=tok_of("tokenizer.ggml.bos_token_id"),
            eos_token=tok_of("tokenizer.ggml.eos_token_id"),
            pad_token=tok_of("tokenizer.ggml.padding_token_id"),
            unk_token=tok_of("tokenizer.ggml.unknown_token_id"),
            add_bos_token=bool(get("tokenizer.ggml.add_bos_token", False)),
            add_eos_token=bool(get("tokenizer.ggml.add_eos_token", False)),
            extra_eos_token_ids=[e for e in extra_eos if e is not None],
        )

    def save_hf_dir(self, path: str | Path) -> None:
        """Writes this tokenizer in the form `from_hf_dir` reads back (tokenizer.json,
        tokenizer_config.json, generation_config.json for the end-of-sequence ids): how a GGUF's
        tokenizer is kept, rebuilt once (models_repo.load_tokenizer)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tk.save(str(path / "tokenizer.json"))
        cfg = {"chat_template": self.chat_template, "bos_token": self.bos_token, "eos_token": self.eos_token,
               "pad_token": self.pad_token, "unk_token": self.unk_token, "add_bos_token": self.add_bos_token,
               "add_eos_token": self.add_eos_token}
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": self.eos_token_ids}),
                                                     encoding="utf-8")

    # -- basic API

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self.tk.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tk.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tk.id_to_token(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.  With add_special_tokens, the tokenizer.json
        post-processor runs and BOS/EOS are added when the config asks for them.
        Encode a rendered chat template with add_special_tokens=False (as
        Transformers does): the template already wrote the special tokens."""
        ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None and (not ids or ids[-1] != self.eos_token_id):
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special_tokens_map(self) -> dict[str, str]:
        """The variables a chat template sees for the special tokens (bos_token, eos_token, ...)."""
        names = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                 "unk_token": self.unk_token, "pad_token": self.pad_token}
        return {k: v for k, v in names.items() if v is not None}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None, **kwargs: Any) -> str:
        """Render the conversation to a prompt string (not tokenized), like
        Transformers' ``apply_chat_template(..., tokenize=False)``; chat_template: instead of the model's."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template")
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, **{**self.special_tokens_map(), **kwargs})


# ---------------------------------------------------------- detokenization


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas for streaming.

    * UTF-8 safe: a character whose bytes span several tokens is emitted once all
      of them arrived (``tokenizers.decoders.DecodeStream`` when available, else
      the prefix-offset method), so deltas concatenate to the full decode.
    * Stop strings, OpenAI semantics: output ends right before the first stop
      string, which is not returned.  Until a tail of the text can no longer be
      the beginning of a stop string it is held back; ``flush()`` releases it.

    ``text`` is all text decoded so far (held-back tail included), cut before the
    stop string once ``stopped``.  ``emitted`` is the length of text returned so far.
    """

    def __init__(self, tokenizer: Tokenizer | _RustTokenizer, stop: Iterable[str] | None = None,
                 skip_special_tokens: bool = True, use_decode_stream: bool | None = None,
                 include_stop_str_in_output: bool = False):
        self._tk = tokenizer.tk if isinstance(tokenizer, Tokenizer) else tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output  # the text ends after the stop string, not before
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.matched_stop: str | None = None
        self._max_stop = max((len(s) for s in self.stop), default=0)
        if use_decode_stream is None:
            use_decode_stream = hasattr(decoders, "DecodeStream")
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens) if use_decode_stream else None
        self._prefix_offset = 0  # prefix-offset fallback state
        self._read_offset = 0
        self._pending = 0  # ids fed whose text has not come out yet (incomplete UTF-8)

    # -- decoding

    def _step(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        if self._stream is not None:
            out = self._stream.step(self._tk, token_id)
        else:
            ids, skip = self.token_ids, self.skip_special_tokens
            prefix = self._tk.decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
            full = self._tk.decode(ids[self._prefix_offset:], skip_special_tokens=skip)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                out = full[len(prefix):]
                self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            else:
                out = None
        if out is None:
            self._pending += 1
            return ""
        self._pending = 0
        return out

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed one or more generated ids; return the text that is now safe to emit."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if self.stopped:
            return ""
        start = len(self.text)
        for t in token_ids:
            self.text += self._step(int(t))
            # Check after every token so ids after a stop do not leak into .text.
            if self.stop and self._check_stop(start):
                break
        return self._release(final=False)

    def flush(self) -> str:
        """End of generation: emit whatever was held back (and any incomplete
        UTF-8 tail, decoded with replacement characters)."""
        if not self.stopped and self._pending:
            full = self._tk.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
            if full.startswith(self.text) and len(full) > len(self.text):
                start = len(self.text)
                self.text = full
                self._pending = 0
                if self.stop:
                    self._check_stop(start)
        return self._release(final=True)

    # -- stop strings

    def _check_stop(self, start: int) -> bool:
        """Look for a stop string that ends in the text added since ``start``."""
        lo = max(0, start - self._max_stop + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, lo)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.text = self.text[:best[0] + (len(best[1]) if self.include_stop else 0)]
        self.stopped, self.matched_stop = True, best[1]
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        text, n = self.text, 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), n, -1):
                if text.endswith(s[:k]):
                    n = k
                    break
        return n

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back()
        end = max(end, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
