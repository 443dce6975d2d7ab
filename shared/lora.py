"""LoRA adapters in PEFT's format, read and checked against a base model without torch.

An adapter is a directory with `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`use_rslora`, `base_model_name_or_path`, ...) and `adapter_model.safetensors`, whose tensors are
named like `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). The gateway checks an adapter here before it serves it (the admin
endpoint answers a 4xx, a manifest entry shows `failed` in /v1/models), and the worker checks it
again when it builds the tensors (shared/model/lora.py); both use `check_adapter`, so what one
accepts the other does too.

Not supported (refused with the reason): DoRA, trained biases, `modules_to_save`, rank or alpha
patterns, `fan_in_fan_out`, and targets other than the decoder's seven projections.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The decoder's projections an adapter may target, and where each sits: the fused projection of
# shared/model/llama.py that holds it (q|k|v and gate|up are one matrix each there).
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?"
                  r"\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served (unreadable, unsupported, or not for this base model)."""


@dataclass(frozen=True)
class AdapterSpec:
    """What the files say, before any tensor is read."""

    path: str
    r: int
    alpha: float
    use_rslora: bool
    base_model: str | None  # base_model_name_or_path
    target_modules: tuple[str, ...]
    # tensor name -> (layer, module, "A" | "B", shape, safetensors dtype)
    tensors: dict[str, tuple[int, str, str, tuple[int, ...], str]] = field(default_factory=dict)
    key: str = ""  # a hash of both files' bytes: the adapter's identity (prefix-cache keys, reloads)

    @property
    def scaling(self) -> float:
        """What B @ A is multiplied by: alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's rule)."""
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @property
    def weights_file(self) -> Path:
        return Path(self.path) / WEIGHTS_FILE


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a decoder projection of the base model."""
    q, kv, h, i = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}[module]


def _read_weights(where: Path, digest) -> dict:
    """The safetensors header of the weights file (its tensor list), hashing the whole file into
    `digest` as it goes (in chunks: an adapter may be hundreds of MB)."""
    with open(where, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise LoRAError(f"{where} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise LoRAError(f"{where} is not a safetensors file (a {n}-byte header)")
        raw = f.read(n)
        digest.update(head + raw)
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise LoRAError(f"{where} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise LoRAError(f"{where} is not a safetensors file")
    header.pop("__metadata__", None)
    return header


def read_adapter(path: str | Path) -> AdapterSpec:
    """Reads an adapter directory's config and tensor list; raises LoRAError saying what is wrong."""
    try:
        d = Path(path).expanduser()
        is_dir = d.is_dir()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, an unknown ~user
        is_dir = False
    if not is_dir:
        raise LoRAError(f"the LoRA adapter path {str(path)!r} is not a directory")
    digest = hashlib.blake2b(digest_size=8)
    try:
        raw_cfg = (d / CONFIG_FILE).read_bytes()
        digest.update(raw_cfg)
        header = _read_weights(d / WEIGHTS_FILE, digest)
    except OSError as e:
        raise LoRAError(f"the LoRA adapter at {d} cannot be read: {e.strerror or e}: {e.filename}") from None
    try:
        cfg = json.loads(raw_cfg)
    except ValueError as e:
        raise LoRAError(f"{d / CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{d / CONFIG_FILE} is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"the adapter at {d} is a {peft_type} adapter; only LoRA adapters are supported")
    unsupported = [k for k, off in (("use_dora", False), ("fan_in_fan_out", False)) if cfg.get(k, off)]
    unsupported += [k for k in ("modules_to_save", "rank_pattern", "alpha_pattern") if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(f"bias={cfg['bias']!r}")
    if unsupported:
        raise LoRAError(f"the adapter at {d} uses {', '.join(unsupported)}, which this server does not support")
    try:
        r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    except (KeyError, TypeError, ValueError):
        raise LoRAError(f"{d / CONFIG_FILE} needs an integer `r` (and a number `lora_alpha`)") from None
    if r <= 0:
        raise LoRAError(f"{d / CONFIG_FILE}: r must be positive, not {r}")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str) or not isinstance(targets, list):  # a regex over module paths (PEFT):
        targets = []  # the tensors say which modules it adapts, and each is checked below
    tensors = {}
    for name, info in header.items():
        m = _KEY.match(name)
        if m is None:
            raise LoRAError(f"the adapter at {d} holds the tensor {name!r}, which is not a LoRA A/B matrix of a "
                            "decoder layer's projection (only q/k/v/o/gate/up/down_proj are supported)")
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list):
            raise LoRAError(f"{d / WEIGHTS_FILE} is not a safetensors file (tensor {name!r} has no shape)")
        layer, _, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        tensors[name] = (layer, module, ab, tuple(info["shape"]), str(info.get("dtype")))
    if not tensors:
        raise LoRAError(f"the adapter at {d} holds no LoRA tensors")
    key = digest.hexdigest()
    base = cfg.get("base_model_name_or_path")
    return AdapterSpec(str(d.resolve()), r, alpha, bool(cfg.get("use_rslora", False)), base if base else None,
                       tuple(str(t) for t in targets), tensors, key)


def model_id(name: str) -> str:
    """A model name compared loosely: the last path component, lower case, without .gguf or a
    quantization suffix (HuggingFaceTB/SmolLM2-135M-Instruct ~ smollm2-135m-instruct.q4_1.gguf)."""
    s = Path(str(name).rstrip("/")).name.lower()
    s = re.sub(r"\.gguf$", "", s)
    return re.sub(r"[.-](q\d\w*|iq\d\w*|f16|bf16|f32)$", "", s)


def check_adapter(spec: AdapterSpec, cfg: ModelConfig, base_names: tuple[str, ...] | list[str] = ()) -> None:
    """Raises LoRAError unless the adapter fits the base model: its base_model_name_or_path names one
    of `base_names` (when both are given), its targets are projections the model has, and every
    tensor's layer and shape match the model's."""
    if spec.base_model and base_names and model_id(spec.base_model) not in {model_id(n) for n in base_names}:
        raise LoRAError(f"the adapter at {spec.path} was trained for {spec.base_model!r}, not for this base model "
                        f"({', '.join(repr(n) for n in base_names)})")
    missing = [t for t in spec.target_modules if t.split(".")[-1] not in MODULES]
    if missing:
        raise LoRAError(f"the adapter at {spec.path} targets {', '.join(repr(t) for t in missing)}, which the base "
                        f"model does not have as a LoRA-able projection (it has {', '.join(MODULES)})")
    seen: dict[tuple[int, str], set[str]] = {}
    for name, (layer, module, ab, shape, dtype) in spec.tensors.items():
        if module not in MODULES:
            raise LoRAError(f"the adapter at {spec.path} has {name!r}: the base model has no module {module!r}")
        if layer >= cfg.num_hidden_layers:
            raise LoRAError(f"the adapter at {spec.path} has {name!r}, but the base model has "
                            f"{cfg.num_hidden_layers} layers")
        fan_in, fan_out = module_shape(cfg, module)
        want = (spec.r, fan_in) if ab == "A" else (fan_out, spec.r)
        if shape != want:
            raise LoRAError(f"the adapter at {spec.path} does not fit the base model: {name!r} has shape "
                            f"{list(shape)}, the base model needs {list(want)} (r={spec.r})")
        if dtype not in ("F32", "F16", "BF16"):
            raise LoRAError(f"the adapter at {spec.path} has {name!r} in {dtype}; expected F32, F16 or BF16")
        seen.setdefault((layer, module), set()).add(ab)
    half = [f"layer {la} {mo}" for (la, mo), abs_ in seen.items() if abs_ != {"A", "B"}]
    if half:
        raise LoRAError(f"the adapter at {spec.path} lacks the A or the B matrix of {', '.join(half[:3])}")
