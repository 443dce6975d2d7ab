"""The gateway's view of the models it serves: the manifest (shared/manifest.py), and per model its
tokenizer, generation defaults and context length, loaded on first use (a model nobody asks for costs nothing here).

Requests name a model by its served name, an alias or a LoRA adapter's name (adapters.py: the
request then runs on the adapter's base); `entry` resolves it (of a name with canary versions: one
by their shares; with variants: the one for the request's class and tenant) or raises the OpenAI
error (404 for a name not in the manifest, 500 naming the cause when its tokenizer cannot load).
`reload` swaps in a re-read manifest: requests already running keep the entry they resolved.
"""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass, field

from meshserve.shared.manifest import Manifest, ServedModel, load_manifest
from meshserve.shared.model.config import MAX_CONTEXT
from meshserve.shared.models_repo import context_length, generation_defaults, load_tokenizer
from meshserve.shared.openai_protocol import OpenAIError
from meshserve.shared.schemas import LoRARef
from meshserve.shared.tokenizer import Tokenizer

from .adapters import Adapters

log = logging.getLogger("meshserve.gateway")


@dataclass
class ModelEntry:
    spec: ServedModel
    tokenizer: Tokenizer
    generation_defaults: dict = field(default_factory=dict)
    max_model_len: int = MAX_CONTEXT  # its context: prompt plus output (Catalog.max_model_len)
    lora: LoRARef | None = None  # a LoRA adapter of spec's model, served under its own name (adapters.py)
    reasoning_parser: str | None = None  # shared/reasoning.py's name: its chat answers' split
    tool_call_parser: str | None = None  # shared/tool_calls.py's name: how "auto" reads its calls

    @property
    def name(self) -> str:
        """The served name (what the response says): the model's, or its adapter's."""
        return self.lora.name if self.lora is not None else self.spec.name

    @property
    def id(self) -> str:
        """What the mesh calls it: the name, or name@version for a canary version, or name@variant."""
        return self.spec.id


class Catalog:
    def __init__(self, manifest: Manifest, path: str | None = None, preloaded: dict[str, ModelEntry] | None = None,
                 max_model_len: int | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None):
        """max_model_len: the longest context of any model here (the gateway's --max-model-len); None:
        each model's own, as its workers serve it by default. reasoning_parser, tool_call_parser: the
        gateway's flags, for the models whose manifest entry names none."""
        self.manifest, self.path, self.max_model_len_cap = manifest, path, max_model_len
        self.reasoning_parser, self.tool_call_parser = reasoning_parser, tool_call_parser
        self._entries: dict[str, ModelEntry] = dict(preloaded or {})
        self._lock = threading.Lock()
        self.adapters = Adapters(manifest)  # LoRA adapters of the manifest's models, and loaded at run time

    @classmethod
    def single(cls, name: str, tokenizer: Tokenizer, defaults: dict | None = None, path: str | None = None,
               max_model_len: int | None = None, reasoning_parser: str | None = None,
               tool_call_parser: str | None = None):
        """One model whose tokenizer is already loaded (`--model`)."""
        m = Manifest.single(path or name, name)
        catalog = cls(m, None, max_model_len=max_model_len, reasoning_parser=reasoning_parser,
                      tool_call_parser=tool_call_parser)
        catalog._entries[name] = ModelEntry(m.models[0], tokenizer, dict(defaults or {}),
                                            catalog.max_model_len(m.models[0]), **catalog.parsers_of(m.models[0]))
        return catalog

    @property
    def default(self) -> ModelEntry:
        return self.entry(None)

    def entry(self, name: str | None, priority: str | None = None, tenant: str | None = None) -> ModelEntry:
        """The model a request runs on (of a name with versions: one of them, by their shares; of a
        name with variants: the one for its class and tenant, shared/manifest.py `variant_for`); for a
        LoRA adapter's name, its base model with the adapter."""
        adapter = self.adapters.find(name) if name is not None else None
        if adapter is not None:
            ref = self.adapters.ref(adapter)
            base = self.entry_of(adapter.base)
            return ModelEntry(base.spec, base.tokenizer, base.generation_defaults, base.max_model_len, ref,
                              base.reasoning_parser, base.tool_call_parser)
        spec = self.manifest.pick(name, random.random(), priority, tenant)
        if spec is None:
            served = self.manifest.names + [a.name for a in self.adapters.all()]
            raise OpenAIError(f"the model {name!r} does not exist; this server serves "
                              f"{', '.join(repr(n) for n in served)}", 404, param="model",
                              code="model_not_found")
        return self.entry_of(spec)

    def entry_of(self, spec: ServedModel) -> ModelEntry:
        with self._lock:
            e = self._entries.get(spec.id)
            if e is not None and e.spec.path == spec.path:
                if e.spec != spec:  # same weights, new settings (aliases, share, pinning)
                    e = self._entries[spec.id] = ModelEntry(spec, e.tokenizer, e.generation_defaults, e.max_model_len,
                                                            **self.parsers_of(spec))
                return e
            try:
                tok = load_tokenizer(spec.path)
            except Exception as err:  # noqa: BLE001 - the client must hear why the model cannot serve
                log.warning("model %s: cannot load its tokenizer from %s: %s", spec.name, spec.path, err)
                raise OpenAIError(f"the model {spec.name!r} cannot be served: its tokenizer does not load from "
                                  f"{spec.path}: {err}", 500, type="server_error", code="model_load_failed") from None
            e = self._entries[spec.id] = ModelEntry(spec, tok, generation_defaults(spec.path), self.max_model_len(spec),
                                                    **self.parsers_of(spec))
            return e

    def parsers_of(self, spec: ServedModel) -> dict:
        """How its answers are read: its manifest entry's parsers, else this gateway's flags."""
        return {"reasoning_parser": spec.reasoning_parser or self.reasoning_parser,
                "tool_call_parser": spec.tool_call_parser or self.tool_call_parser}

    def max_model_len(self, spec: ServedModel) -> int:
        """A model's context: its config's (ModelConfig.context_length, what its workers serve unless
        started with a shorter --max-model-len, which the scheduler then enforces), at most this
        gateway's --max-model-len."""
        try:
            n = context_length(spec.path)
        except Exception as err:  # noqa: BLE001 - its tokenizer loaded, so the workers will say what is wrong
            log.warning("model %s: cannot read its context length from %s: %s", spec.name, spec.path, err)
            n = MAX_CONTEXT
        return min(n, self.max_model_len_cap or n)

    def reload(self) -> Manifest:
        """Re-reads the manifest file (raises ManifestError, keeping the old one, when it is bad)."""
        if self.path is None:
            raise OpenAIError("this gateway was started without --models: there is no manifest to reload", 400,
                              code="no_manifest")
        m = load_manifest(self.path)
        self.adapters.reload(m)
        with self._lock:
            self.manifest = m
            names = set(m.ids)
            for n in [n for n in self._entries if n not in names]:
                del self._entries[n]
        log.info("manifest reloaded from %s: %s", self.path, ", ".join(m.names))
        return m
