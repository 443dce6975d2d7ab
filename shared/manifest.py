"""The model manifest (`--models FILE`): which models one mesh serves, and how.

A YAML list of models (or a mapping with the list under `models`), each:

    - name: chat                    # the served name (what requests put in `model`)
      path: smollm2-135m-instruct   # a known model name, a Hugging Face directory or a .gguf file
      aliases: [default]            # other names that reach it
      version: "2"                  # shown in /v1/models and the `meshserve-model-version` header
      dtype: bfloat16               # float32 | bfloat16 (default: the command's --dtype)
      quantization: int8            # optional (docs/quantization.md)
      pinned: true                  # never evicted from the loader's hot tier
      memory_quota_gb: 1.0          # the most its weights may take (a load above it fails)

`--model M` is the one-model manifest (`Manifest.single`). One module parses and checks it for every
service (the gateway, the scheduler, the model-loader and the launcher read it; none imports torch
here); a key it does not know is an error, never ignored. Relative paths are relative to the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from meshserve.shared.model.config import Quantization


class ManifestError(ValueError):
    """The manifest file is missing, not YAML, or not a valid list of models."""


class ServedModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    aliases: tuple[str, ...] = ()
    version: str | None = None
    dtype: Literal["float32", "bfloat16"] | None = None
    quantization: Quantization | None = None
    pinned: bool = False
    memory_quota_gb: float | None = Field(default=None, gt=0)

    @field_validator("version", mode="before")
    @classmethod
    def _version_text(cls, v):
        return None if v is None else str(v)

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
        for m in self.models:
            for n in m.names():
                if n in seen:
                    raise ValueError(f"the name {n!r} is given twice (models {seen[n]!r} and {m.name!r}); "
                                     "each served name and alias must be unique")
                seen[n] = m.name
        return self

    @classmethod
    def single(cls, path: str, served_name: str | None = None, dtype: str | None = None,
               quantization: str | None = None) -> "Manifest":
        """What `--model M` means: a manifest of that one model."""
        return cls(models=(ServedModel(name=served_name or str(path), path=str(path), dtype=dtype,
                                     quantization=quantization),))

    def get(self, name: str | None) -> ServedModel | None:
        """The model a request's `model` names (its name or an alias); None names the first."""
        if name is None:
            return self.models[0]
        return next((m for m in self.models if name in m.names()), None)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def by_weights(self, default_dtype: str) -> dict[tuple[str, str, str | None], ServedModel]:
        return {m.weights_key(default_dtype): m for m in self.models}


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
            q = Path(item["path"]).expanduser()
            if not q.is_absolute() and (p.parent / q).exists():
                item = {**item, "path": str((p.parent / q).resolve())}
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
            except (UnknownModel, KeyError) as e:
                raise ManifestError(f"{p}: model {m.name!r}: {e}") from None
    return manifest


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
