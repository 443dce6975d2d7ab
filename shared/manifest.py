"""The model manifest (`--models FILE`): which models one mesh serves, and how.

A YAML list of models (or a mapping with the list under `models`), each:

    - name: chat                    # the served name (what requests put in `model`)
      path: smollm2-135m-instruct   # a known model name, a Hugging Face directory or a .gguf file
      aliases: [default]            # other names that reach it
      version: "2"                  # shown in /v1/models and the `meshserve-model-version` header
      dtype: bfloat16               # float32 | bfloat16 (default: the command's --dtype)
      quantization: int8            # optional (docs/quantization.md)
      kv_cache_dtype: int8          # its KV cache (auto | int8; default: the command's --kv-cache-dtype)
      pinned: true                  # never evicted from the loader's hot tier
      memory_quota_gb: 1.0          # its weights plus its KV blocks on a node (weights above it: the load
                                    # fails; KV: the kv-pool leases it at most the rest, shared/partitions.py)
      cpus: "0-1"                   # CPU backend: the cores its workers run on ("0", "0-1", "0,2"), or a
                                    # count (2: that many of the cores no model names)
      gpu_percent: 30               # CUDA: its workers' CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (under MPS)
      layered_loading: false        # workers wait for its whole load (default: the loader's
                                    # --layered-loading, on: its first layers run while the rest loads)
      share: 90                     # canary: two or more entries of one name, each with a version and
                                    # its percent of the name's requests (they sum to 100)
      variant: int8                 # variants: entries of one name, each serving the request classes
      priorities: [background]      # and the tenants it lists (a tenant's entry first, then a class's:
      tenants: [nightly-jobs]       # `variant_for`); the one entry with neither is the default
      adapters:                     # LoRA adapters of this model (PEFT directories), each served
        - {name: chat-sql, path: ./adapters/sql}   # under its own name on the base's workers
      speculative: {method: ngram}  # its own speculative decoding (docs/speculative.md), or false:
                                    # none; without the key, the workers' --speculative flags

`--model M` is the one-model manifest (`Manifest.single`). One module parses and checks it for every
service (the gateway, the scheduler, the model-loader and the launcher read it; none imports torch
here); a key it does not know is an error, never ignored. Relative paths are relative to the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from meshserve.shared.limits import Priority
from meshserve.shared.model.config import Quantization
from meshserve.shared.reasoning import PARSERS as REASONING_PARSERS
from meshserve.shared.tool_calls import PARSERS as TOOL_CALL_PARSERS


class ManifestError(ValueError):
    """The manifest file is missing, not YAML, or not a valid list of models."""


class AdapterEntry(BaseModel):
    """A LoRA adapter served under its own name on its base model's workers (shared/lora.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)


class SpeculativeEntry(BaseModel):
    """A model's own speculative decoding: SpeculativeConfig's fields (shared/engine/speculative.py,
    which holds the defaults of those left out)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft"]
    model: str | None = Field(default=None, min_length=1)  # the draft model, for "draft"
    num_speculative_tokens: int | None = Field(default=None, ge=1)
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    classes: tuple[Priority, ...] | None = None
    disable_by_batch_size: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _draft_model(self) -> "SpeculativeEntry":
        if (self.method == "draft") != (self.model is not None):
            raise ValueError("speculative: method draft needs a `model` (the draft), and only it has one")
        return self


class ServedModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    aliases: tuple[str, ...] = ()
    version: str | None = None
    dtype: Literal["float32", "bfloat16"] | None = None
    quantization: Quantization | None = None
    kv_cache_dtype: Literal["auto", "int8"] | None = None  # None: the node's --kv-cache-dtype
    pinned: bool = False
    memory_quota_gb: float | None = Field(default=None, gt=0)
    cpus: int | str | None = None
    gpu_percent: int | None = Field(default=None, ge=1, le=100)
    share: float | None = Field(default=None, ge=0, le=100)
    variant: str | None = Field(default=None, min_length=1, pattern=r"^[^@\s]+$")
    priorities: tuple[Priority, ...] | None = Field(default=None, min_length=1)
    tenants: tuple[str, ...] | None = Field(default=None, min_length=1)
    layered_loading: bool | None = None
    adapters: tuple[AdapterEntry, ...] = ()
    speculative: SpeculativeEntry | Literal[False] | None = None  # None: the workers' flags
    # How its chat answers split into reasoning and answer (shared/reasoning.py); None: the gateway's
    # --reasoning-parser, else none
    reasoning_parser: Literal[REASONING_PARSERS] | None = None
    # How calls are read from its answers under tool_choice auto (shared/tool_calls.py); None: the
    # gateway's --tool-call-parser, else hermes
    tool_call_parser: Literal[TOOL_CALL_PARSERS] | None = None

    @property
    def id(self) -> str:
        """What the mesh calls it inside (queues, workers, the loader): the served name, or
        name@version for a version with a traffic share (a canary), or name@variant."""
        if self.share is not None:
            return f"{self.name}@{self.version}"
        return f"{self.name}@{self.variant}" if self.variant is not None else self.name

    @property
    def is_default_variant(self) -> bool:
        """Serves every class and tenant (no `priorities`, no `tenants`)."""
        return self.priorities is None and self.tenants is None

    @field_validator("version", mode="before")
    @classmethod
    def _version_text(cls, v):
        return None if v is None else str(v)

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v):
        if v is not None:
            from meshserve.shared.partitions import parse_cpus

            parse_cpus(v)  # a PartitionError (a ValueError) says what is wrong
        return v

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def weights_key(self, default_dtype: str) -> tuple[str, str, str | None]:
        """What the model-loader keys its entries by: (path, dtype, quantization)."""
        return self.path, self.dtype or default_dtype, self.quantization


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    models: tuple[ServedModel, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> "Manifest":
        seen: dict[str, str] = {}
        groups: dict[str, list[ServedModel]] = {}
        for m in self.models:
            groups.setdefault(m.name, []).append(m)
            for n in m.names():
                if seen.get(n, m.name) != m.name:
                    raise ValueError(f"the name {n!r} is given twice (models {seen[n]!r} and {m.name!r}); "
                                     "each served name and alias must be unique")
                seen[n] = m.name
        for m in self.models:
            for a in m.adapters:
                if a.name in seen:
                    raise ValueError(f"the adapter name {a.name!r} of model {m.name!r} is already the name of "
                                     f"{'model ' + repr(seen[a.name]) if seen[a.name] else 'another adapter'}; "
                                     "each served name must be unique")
                seen[a.name] = ""
        for name, group in groups.items():
            if any(m.variant is not None or not m.is_default_variant for m in group):
                _check_variants(name, group)
                continue
            if len(group) == 1 and group[0].share is None:
                continue
            if any(m.share is None or m.version is None for m in group):
                raise ValueError(f"the model {name!r} is listed {len(group)} times: versions of one name each need "
                                 "a `version` and a `share` (a canary), variants each a `variant` (docs/models.md)")
            if len({m.version for m in group}) != len(group):
                raise ValueError(f"the model {name!r} lists a version twice")
            if abs(sum(m.share for m in group) - 100) > 1e-6:
                raise ValueError(f"the shares of {name!r}'s versions sum to {sum(m.share for m in group):g}, not 100")
        ids = [m.id for m in self.models]
        twice = next((i for i in ids if ids.count(i) > 1), None)
        if twice is not None:
            raise ValueError(f"two entries are both {twice!r} inside the mesh; give them other names, versions "
                             "or variants")
        return self

    @classmethod
    def single(cls, path: str, served_name: str | None = None, dtype: str | None = None,
               quantization: str | None = None) -> "Manifest":
        """What `--model M` means: a manifest of that one model."""
        return cls(models=(ServedModel(name=served_name or str(path), path=str(path), dtype=dtype,
                                     quantization=quantization),))

    def get(self, name: str | None) -> ServedModel | None:
        """The model an id names (ServedModel.id), or a served name or alias (of a name with
        versions: its first); None names the first model."""
        if name is None:
            return self.models[0]
        return next((m for m in self.models if m.id == name), None) or \
            next((m for m in self.models if name in m.names()), None)

    def adapter(self, name: str | None) -> tuple[AdapterEntry, ServedModel] | None:
        """The adapter a served name names, and its base model; None when it names none."""
        return next(((a, m) for m in self.models for a in m.adapters if a.name == name), None)

    def versions(self, name: str) -> list[ServedModel]:
        """The entries a served name or alias reaches (one, or its versions or variants)."""
        first = next((m for m in self.models if name in m.names()), None)
        return [m for m in self.models if m.name == first.name] if first else []

    def pick(self, name: str | None, u: float, priority: str | None = None,
             tenant: str | None = None) -> ServedModel | None:
        """The entry a request for `name` runs on: of a name with versions, one by the versions'
        shares (`u` uniform in [0, 1)); of a name with variants, the one for the request's class
        and tenant (`variant_for`)."""
        if name is None:
            name = self.models[0].name
        vs = self.versions(name)
        if vs and vs[0].variant is not None:  # (a name listed twice without shares has variants)
            return variant_for(vs, priority or "normal", tenant)
        if len(vs) <= 1 or vs[0].share is None:
            return vs[0] if vs else self.get(name)
        total = 0.0
        for m in vs:
            total += m.share / 100
            if u < total:
                return m
        return next((m for m in reversed(vs) if m.share), vs[-1])

    @property
    def names(self) -> list[str]:
        """The served names, each once."""
        return list(dict.fromkeys(m.name for m in self.models))

    @property
    def tenant_names(self) -> set[str]:
        """The tenants the variants name (the gateway warns of those its tenants file lacks)."""
        return {t for m in self.models for t in (m.tenants or ())}

    @property
    def ids(self) -> list[str]:
        return [m.id for m in self.models]

    def by_weights(self, default_dtype: str) -> dict[tuple[str, str, str | None], ServedModel]:
        return {m.weights_key(default_dtype): m for m in self.models}


def variant_for(group: list[ServedModel], priority: str, tenant: str | None) -> ServedModel:
    """The variant of one name a request runs on: the entry whose `tenants` lists its tenant; else
    the entry whose `priorities` lists its class; else the default (the entry with neither key).
    `_check_variants` makes each of these at most one entry."""
    return next((m for m in group if tenant is not None and tenant in (m.tenants or ())), None) or \
        next((m for m in group if priority in (m.priorities or ())), None) or \
        next(m for m in group if m.is_default_variant)


def _check_variants(name: str, group: list[ServedModel]) -> None:
    """A name's variants: each named, exactly one default, and no tenant nor class listed twice
    (which would leave a request two entries to run on)."""
    if any(m.share is not None for m in group):
        raise ValueError(f"the model {name!r} mixes canary versions (`share`) with variants (`variant`, "
                         "`priorities`, `tenants`); a name has one or the other")
    if any(m.variant is None for m in group):
        raise ValueError(f"the model {name!r} has variants: each of its entries needs a `variant` (the name the "
                         "meshserve-model-variant header shows)")
    if len({m.variant for m in group}) != len(group):
        raise ValueError(f"the model {name!r} lists a variant twice")
    defaults = [m.variant for m in group if m.is_default_variant]
    if len(defaults) != 1:
        raise ValueError(f"the model {name!r} needs exactly one variant without `priorities` and `tenants` (the "
                         f"default, for every request the others do not take); it has "
                         f"{', '.join(map(repr, defaults)) if defaults else 'none'}")
    for key, what in (("priorities", "class"), ("tenants", "tenant")):
        seen: dict[str, str] = {}
        for m in group:
            for x in getattr(m, key) or ():
                if x in seen:
                    raise ValueError(f"the model {name!r}: the {what} {x!r} is listed by two variants ({seen[x]!r} "
                                     f"and {m.variant!r}); each {what} runs on one variant")
                seen[x] = m.variant


def load_manifest(path: str | Path, check_paths: bool = True) -> Manifest:
    """Reads and checks a manifest file; raises ManifestError with what is wrong and where."""
    p = Path(path).expanduser()
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ManifestError(f"cannot read the models file {p}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ManifestError(f"{p} is not valid YAML: {e}") from None
    if isinstance(data, dict) and set(data) == {"models"}:
        data = data["models"]
    if not isinstance(data, list):
        raise ManifestError(f"{p}: expected a list of models (or `models:` with a list), got {type(data).__name__}")
    models = []
    for i, item in enumerate(data):
        if isinstance(item, dict) and isinstance(item.get("path"), str):
            item = {**item, "path": _relative_to(p, item["path"])}
        if isinstance(item, dict) and isinstance(item.get("adapters"), list):
            item = {**item, "adapters": [{**a, "path": _relative_to(p, a["path"])}
                                         if isinstance(a, dict) and isinstance(a.get("path"), str) else a
                                         for a in item["adapters"]]}
        spec = item.get("speculative") if isinstance(item, dict) else None
        if isinstance(spec, dict) and isinstance(spec.get("model"), str):
            item = {**item, "speculative": {**spec, "model": _relative_to(p, spec["model"])}}
        models.append(item)
    try:
        manifest = Manifest(models=models)
    except ValidationError as e:
        raise ManifestError(f"{p}: {_explain(e, data)}") from None
    if check_paths:
        from meshserve.shared.models_repo import UnknownModel, check

        for m in manifest.models:
            try:
                check(m.path)
                if m.speculative and m.speculative.model is not None:
                    check(m.speculative.model)
            except (UnknownModel, KeyError) as e:
                raise ManifestError(f"{p}: model {m.name!r}: {e}") from None
    return manifest


class ManifestFile:
    """A manifest file re-read when it changes (its modification time): what the kv-pool and the
    workers use, who take no SIGHUP or reload message (the file is what a reload re-reads anyway).
    A file that became invalid keeps the last good manifest."""

    def __init__(self, path: str | Path):
        self.path, self.mtime, self.manifest = Path(path), None, None

    def current(self) -> Manifest | None:
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return self.manifest
        if mtime != self.mtime:
            self.mtime = mtime
            try:
                self.manifest = load_manifest(self.path, check_paths=False)
            except ManifestError as e:
                import logging

                logging.getLogger("meshserve.manifest").error("manifest not re-read: %s", e)
        return self.manifest


def _relative_to(manifest: Path, path: str) -> str:
    """A path relative to the manifest file's directory when it exists there (else as written)."""
    q = Path(path).expanduser()
    if not q.is_absolute() and (manifest.parent / q).exists():
        return str((manifest.parent / q).resolve())
    return path


def _explain(e: ValidationError, data) -> str:
    out = []
    for err in e.errors():
        loc = list(err["loc"])
        where = ""
        if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
            item = data[loc[1]] if loc[1] < len(data) else None
            name = item.get("name") if isinstance(item, dict) else None
            where = f"model {loc[1]}" + (f" ({name!r})" if name else "")
            loc = loc[2:]
        field = ".".join(str(x) for x in loc)
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        out.append(f"{where}{': ' if where and field else ''}{field}: {msg}" if (where or field) else msg)
    return "; ".join(out)


def manifest_from_args(args) -> Manifest:
    """The manifest a command serves: `--models FILE`, else `--model` as a one-model manifest."""
    if getattr(args, "models", None):
        return load_manifest(args.models)
    return Manifest.single(args.model, getattr(args, "served_model_name", None), None,
                           getattr(args, "quantization", None))


def add_models_argument(p) -> None:
    p.add_argument("--models", default=None, metavar="FILE",
                   help="model manifest (docs/models.md): the models this mesh serves, with names, aliases, "
                        "dtype, quantization, pinning and memory quotas; SIGHUP or POST /admin/models/reload "
                        "re-reads it (default: --model alone)")
