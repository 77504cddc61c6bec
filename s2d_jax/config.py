"""Typed configs: dataclasses loaded from YAML with `key=value` overrides, validated at load.

Every config is a frozen dataclass, so a `ModelConfig` can be a static argument of `jax.jit`.
Nested sections are addressed with dots in overrides: `model.num_layers=4 train.lr=1e-4`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from typing import Any

import numpy as np
import yaml

from s2d_jax.errors import S2DError
from s2d_jax.readers import read_json, read_yaml

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling`: `linear` and `dynamic` use `factor`; `llama3` uses all four fields."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise S2DError(
                f"unknown rope scaling type {self.rope_type!r}; use one of {', '.join(ROPE_TYPES)}"
            )
        for f in ("factor", "low_freq_factor", "high_freq_factor"):
            if not getattr(self, f) > 0:
                raise S2DError(f"rope_scaling.{f} must be > 0, got {getattr(self, f)}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. `head_dim` defaults to hidden_size // num_heads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    name: str = "llama"

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise S2DError(f"model.{f} must be a positive integer, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise S2DError(
                f"model.num_heads={self.num_heads} is not a multiple of "
                f"model.num_kv_heads={self.num_kv_heads}; pick kv heads dividing the heads"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise S2DError(
                    f"model.hidden_size={self.hidden_size} is not divisible by "
                    f"model.num_heads={self.num_heads}; set model.head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        for f in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, f) > 0:
                raise S2DError(f"model.{f} must be > 0, got {getattr(self, f)}")
        for f in ("dtype", "param_dtype"):
            if getattr(self, f) not in DTYPES:
                raise S2DError(f"model.{f}={getattr(self, f)!r} is not one of {', '.join(DTYPES)}")

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else d * v
        return v * d + self.num_layers * per_layer + d + head

    # --- HF config.json both ways -------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides) -> "ModelConfig":
        """Every field goes through `build`, so a wrong type (a string, null, an empty
        list) is one S2DError naming the field, not a TypeError deep in the model."""
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise S2DError(f"config.json is missing required field(s) {', '.join(missing)}")
        rs = hf.get("rope_scaling") or None
        if rs is None and isinstance(hf.get("rope_parameters"), dict):
            rs = hf["rope_parameters"]  # transformers 5 moved rope settings here
        if rs is not None and not isinstance(rs, dict):
            raise S2DError(f"rope_scaling={rs!r} is not a mapping")
        rs = rs or {}
        rope = {k: rs[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings") if k in rs}
        rope["rope_type"] = rs.get("rope_type", rs.get("type", "default"))
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):  # several end-of-sequence ids: the first one
            if not eos:
                raise S2DError("eos_token_id=[] is an empty list, not a token id")
            eos = eos[0]
        kw = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or 0,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=rs.get("rope_theta", hf.get("rope_theta", 10000.0)),
            rope_scaling=rope,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings") or False,
            bos_token_id=1 if hf.get("bos_token_id") is None else hf["bos_token_id"],
            eos_token_id=2 if eos is None else eos,
        )
        kw.update(overrides)
        return build(cls, kw)

    def to_hf_config(self) -> dict[str, Any]:
        hf = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": self.param_dtype,
        }
        r = self.rope_scaling
        if r.rope_type != "default":
            hf["rope_scaling"] = {"rope_type": r.rope_type, "factor": r.factor}
            if r.rope_type == "llama3":
                hf["rope_scaling"].update(
                    low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                    original_max_position_embeddings=r.original_max_position_embeddings)
        return hf


# --- what a loader's `num_layers` and `dtype` arguments do, for every model format ------

def normalize_dtype(dtype) -> str:
    """'bfloat16' / jnp.bfloat16 / np.float32 ... -> one of DTYPES, else S2DError."""
    if isinstance(dtype, bool) or isinstance(dtype, (int, float)):
        name = None  # np.dtype(0) is a float64 by accident, not a choice
    elif isinstance(dtype, str):
        name = dtype  # by its name only: numpy would read "e" or "f2" as float16
    else:
        try:  # numpy parses strings as dtype specs: "," is a SyntaxError there
            name = np.dtype(dtype).name
        except Exception:
            name = None
    if name not in DTYPES:
        raise S2DError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return name


def stored_dtype(dtype) -> str:
    """The DTYPES name params stored as `dtype` keep (float32 for any other, e.g. float64
    or a dequantized GGUF block type)."""
    name = np.dtype(dtype).name
    return name if name in DTYPES else "float32"


def with_dtype(cfg: ModelConfig, dtype, stored) -> ModelConfig:
    """`cfg` for params loaded with `dtype`, the one rule of every loader: None keeps the
    params as stored (`stored_dtype(stored)`) and the compute dtype as configured; a dtype
    casts the params and becomes the compute dtype too."""
    if dtype is None:
        return dataclasses.replace(cfg, param_dtype=stored_dtype(stored))
    dtype = normalize_dtype(dtype)
    return dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype)


def first_layers(cfg: ModelConfig, num_layers: int | None, source: str) -> ModelConfig:
    """`cfg` keeping the first `num_layers` decoder layers (a draft initialised from a
    target; None keeps all), S2DError unless 1 <= num_layers <= the layers `source` holds."""
    if num_layers is None:
        return cfg
    if not 1 <= num_layers <= cfg.num_layers:
        raise S2DError(f"num_layers={num_layers} is outside 1..{cfg.num_layers} (the layers "
                       f"in {source}); pass a layer count in that range")
    return dataclasses.replace(cfg, num_layers=num_layers)


def read_hf_config(path: str) -> ModelConfig:
    """ModelConfig from an HF `config.json` file or a directory holding one."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise S2DError(f"no config.json at {path}; pass an HF model directory")
    hf = read_json(path, "HF config")
    if not isinstance(hf, dict):
        raise S2DError(f"HF config {path} is not a JSON object; fix or re-export it")
    try:
        return ModelConfig.from_hf_config(hf)
    except S2DError as e:
        raise S2DError(f"HF config {path}: {e}; fix the file or re-export the model") from None


def finite_float(value: float, where: str) -> float:
    """NaN and inf pass every `x <= 0` check and poison what they touch (a NaN learning
    rate trains a NaN model): refuse them wherever a float enters from the user."""
    if not math.isfinite(value):
        raise S2DError(f"{where}={value} is not a finite number; give a finite value")
    return value


# --- YAML loading with overrides ---------------------------------------------------------

def _parse_scalar(text: str, override: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as e:
        raise S2DError(f"override {override!r}: {text!r} is not a YAML value "
                       f"({str(e).splitlines()[0]}); fix it, e.g. draft.exits=[2,3]") from None


def _coerce(cls_or_type, value, where: str):
    """Build a value of the annotated type from YAML data, with errors that name `where`."""
    origin = typing.get_origin(cls_or_type)
    if dataclasses.is_dataclass(cls_or_type):
        if isinstance(value, cls_or_type):
            return value
        if not isinstance(value, dict):
            raise S2DError(f"{where} must be a mapping, got {value!r}")
        return build(cls_or_type, value, where)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(cls_or_type) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, where)
    if origin is tuple:
        (elem, *_rest) = typing.get_args(cls_or_type)
        if isinstance(value, (int, float, str)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise S2DError(f"{where} must be a list, got {value!r}")
        return tuple(_coerce(elem, v, f"{where}[{i}]") for i, v in enumerate(value))
    if cls_or_type is float and isinstance(value, str):
        # YAML 1.1 reads "3e-3" (no dot) as a string.
        try:
            return finite_float(float(value), where)
        except ValueError:
            raise S2DError(f"{where}={value!r} is not a float")
    if cls_or_type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return finite_float(float(value), where)
    if cls_or_type is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if cls_or_type in (int, float, str, bool) and not isinstance(value, cls_or_type):
        name = cls_or_type.__name__
        raise S2DError(f"{where}={value!r} is not {'an' if name == 'int' else 'a'} {name}")
    if cls_or_type is int and isinstance(value, bool):
        raise S2DError(f"{where}={value!r} is not an int")
    return value


def build(cls, data: dict[str, Any], where: str = ""):
    """Instantiate dataclass `cls` from a dict, refusing unknown keys."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise S2DError(f"unknown config key {key!r}; valid keys here: {', '.join(sorted(names))}")
    kwargs = {}
    for k, v in data.items():
        kwargs[k] = _coerce(hints[k], v, f"{where}.{k}" if where else k)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise S2DError(f"config section {where or cls.__name__}: {e}")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings to a nested dict (values parsed as YAML scalars)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for ov in overrides:
        if "=" not in ov:
            raise S2DError(f"override {ov!r} is not key=value (e.g. train.lr=1e-4)")
        key, text = ov.split("=", 1)
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise S2DError(f"override {key!r}: {p!r} is not a section")
        node[parts[-1]] = _parse_scalar(text, ov)
    return data


def load_yaml(path: str, _includers: tuple[str, ...] = ()) -> dict[str, Any]:
    if os.path.realpath(path) in _includers:  # a `base` chain that comes back: no end
        raise S2DError(f"config file {path} includes itself through 'base' "
                       f"({' -> '.join(_includers + (os.path.realpath(path),))}); remove the "
                       f"loop")
    if not os.path.isfile(path):
        raise S2DError(f"config file {path} not found; pass a YAML file from configs/")
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise S2DError(f"config file {path} is not a YAML mapping (key: value lines); fix it")
    # `base: other.yaml` includes another file (relative to this one) and overlays this one.
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise S2DError(f"config file {path}: base={base!r} is not a file name; give one YAML "
                       f"path")
    if base:
        parent = load_yaml(os.path.join(os.path.dirname(path), base),
                           _includers + (os.path.realpath(path),))
        data = _deep_merge(parent, data)
    return data


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(cls, path: str | None, overrides: list[str] = ()):
    """Load dataclass `cls` from a YAML file (or defaults) plus `key=value` overrides."""
    data = load_yaml(path) if path else {}
    data = apply_overrides(data, list(overrides))
    return build(cls, data)


def load_model_config(path: str, overrides: list[str] = ()) -> ModelConfig:
    """A ModelConfig from a YAML file in configs/models or an HF dir / config.json."""
    if os.path.isdir(path) or path.endswith(".json"):
        cfg = read_hf_config(path)
        data = dataclasses.asdict(cfg)
        data = apply_overrides(data, list(overrides))
        return build(ModelConfig, data)
    return load_config(ModelConfig, path, overrides)
