"""The LoRA adapters the gateway serves: those the manifest lists under their base model, and those
loaded at run time through vLLM's admin endpoints (`POST /v1/load_lora_adapter` {lora_name,
lora_path}, `POST /v1/unload_lora_adapter` {lora_name}).

An adapter is checked here against its base (shared/lora.py: its files, base_model_name_or_path,
target modules and every tensor's shape against the base's config) before any request runs with it;
the result is kept per (name, path, base), so a manifest adapter that does not fit shows `failed`
with why in /v1/models and its requests are refused with that reason. A request for an adapter
becomes a request for its base with a `LoRARef` (shared/schemas.py): the scheduler routes it to the
base's workers, which read the adapter's files themselves.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from meshserve.shared.lora import LoRAError, check_adapter, model_id, read_adapter
from meshserve.shared.manifest import Manifest, ServedModel
from meshserve.shared.models_repo import model_config
from meshserve.shared.openai_protocol import OpenAIError
from meshserve.shared.schemas import LoRARef


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body, plus `base_model`: which served model it adapts (needed only when the manifest has
    several and the adapter's base_model_name_or_path names none of them)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    base: ServedModel
    runtime: bool  # loaded through the admin endpoint (else listed in the manifest)


def base_names(base: ServedModel) -> tuple[str, ...]:
    """What an adapter's base_model_name_or_path may say for this base (compared by shared/lora.py)."""
    return (base.name, *base.aliases, base.path)


class Adapters:
    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self._runtime: dict[str, tuple[str, str]] = {}  # name -> (base model id, path)
        self._checked: dict[tuple[str, str, str], LoRARef | str] = {}  # (name, path, base id) -> ref or why not
        self._lock = threading.Lock()

    def all(self) -> list[Adapter]:
        out = [Adapter(a.name, a.path, m, False) for m in self.manifest.models for a in m.adapters]
        for name, (base_id, path) in list(self._runtime.items()):
            base = self.manifest.get(base_id)
            if base is not None:
                out.append(Adapter(name, path, base, True))
        return out

    def find(self, name: str | None) -> Adapter | None:
        return next((a for a in self.all() if a.name == name), None)

    def state(self, a: Adapter) -> LoRARef | str:
        """Its LoRARef once checked against its base, or why it cannot be served (checked once)."""
        key = (a.name, a.path, a.base.id)
        with self._lock:
            got = self._checked.get(key)
        if got is None:
            try:
                spec = read_adapter(a.path)
                check_adapter(spec, model_config(a.base.path), base_names(a.base))
                got = LoRARef(name=a.name, path=spec.path, key=spec.key)
            except LoRAError as e:
                got = str(e)
            except Exception as e:  # noqa: BLE001 - the base's config unreadable: say so
                got = f"the base model {a.base.name!r} cannot be read: {type(e).__name__}: {e}"
            with self._lock:
                self._checked[key] = got
        return got

    def ref(self, a: Adapter) -> LoRARef:
        """What a request for it carries; raises the OpenAI error when it cannot be served."""
        got = self.state(a)
        if isinstance(got, str):
            raise OpenAIError(f"the model {a.name!r} is unavailable: its LoRA adapter does not load: {got}", 503,
                              type="server_error", code="model_load_failed")
        return got

    def load(self, req: LoadLoRAAdapterRequest) -> Adapter:
        """The admin endpoint's load: checked now; a 4xx saying why when it does not fit."""
        name = req.lora_name
        if self.manifest.get(name) is not None or self.find(name) is not None:
            raise OpenAIError(f"the name {name!r} is already served (a model or an adapter); unload it first or "
                              "pick another lora_name", 400, param="lora_name", code="lora_name_in_use")
        try:
            spec = read_adapter(req.lora_path)
        except LoRAError as e:
            raise OpenAIError(str(e), 400, param="lora_path", code="invalid_lora_adapter") from None
        base = self._base_of(req.base_model, spec.base_model)
        try:
            cfg = model_config(base.path)
        except Exception as e:  # noqa: BLE001 - not the request's fault: say what failed
            raise OpenAIError(f"the base model {base.name!r} cannot be read to check the adapter: "
                              f"{type(e).__name__}: {e}", 500, type="server_error") from None
        try:
            check_adapter(spec, cfg, base_names(base))
        except LoRAError as e:
            raise OpenAIError(f"the LoRA adapter {name!r} does not fit the model {base.name!r}: {e}", 400,
                              param="lora_path", code="invalid_lora_adapter") from None
        a = Adapter(name, req.lora_path, base, True)
        with self._lock:
            self._runtime[name] = (base.id, req.lora_path)
            self._checked[(a.name, a.path, base.id)] = LoRARef(name=name, path=spec.path, key=spec.key)
        return a

    def _base_of(self, named: str | None, trained_for: str | None) -> ServedModel:
        if named is not None:
            base = self.manifest.get(named)
            if base is None:
                raise OpenAIError(f"base_model: the model {named!r} does not exist; this server serves "
                                  f"{', '.join(repr(n) for n in self.manifest.names)}", 404, param="base_model",
                                  code="model_not_found")
            return base
        firsts = [self.manifest.versions(n)[0] for n in self.manifest.names]
        if len(firsts) == 1:
            return firsts[0]
        fits = [m for m in firsts if trained_for and model_id(trained_for) in {model_id(x) for x in base_names(m)}]
        if len(fits) == 1:
            return fits[0]
        raise OpenAIError(f"which model does this adapter adapt? Its base_model_name_or_path ({trained_for!r}) names "
                          f"{'several' if fits else 'none'} of the served models; say it in `base_model`", 400,
                          param="base_model", code="base_model_required")

    def unload(self, req: UnloadLoRAAdapterRequest) -> Adapter:
        a = self.find(req.lora_name)
        if a is None:
            raise OpenAIError(f"no LoRA adapter {req.lora_name!r} is loaded", 404, param="lora_name",
                              code="lora_adapter_not_found")
        if not a.runtime:
            raise OpenAIError(f"the adapter {a.name!r} is listed in the manifest: remove it there and reload", 400,
                              param="lora_name", code="lora_adapter_in_manifest")
        with self._lock:
            self._runtime.pop(a.name, None)
        return a

    def reload(self, manifest: Manifest) -> None:
        """A new manifest: adapters are checked again (their files may have changed); run-time ones
        whose base is gone are dropped, as are those whose name the manifest now takes."""
        with self._lock:
            self.manifest = manifest
            self._checked.clear()
            taken = {a.name for m in manifest.models for a in m.adapters}
            self._runtime = {n: (b, p) for n, (b, p) in self._runtime.items()
                             if manifest.get(b) is not None and manifest.get(n) is None and n not in taken}
