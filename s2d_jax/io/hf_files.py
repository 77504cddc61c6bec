"""HF weight files, read one tensor at a time: safetensors (memory-mapped, bfloat16 too),
pytorch_model*.bin (torch.load, mmap), single or sharded with an index; and a safetensors
shard writer. Every damaged-file case becomes one S2DError naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np
from safetensors import TensorSpec, serialize_file

from s2d_jax.errors import S2DError
from s2d_jax.readers import read_json

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
              "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _counts(xs) -> bool:
    """A JSON list of non-negative integers (a shape, byte offsets)."""
    return isinstance(xs, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                        and x >= 0 for x in xs)


class _SafetensorsFile:
    """Memory-mapped reader (safetensors' own numpy reader has no bfloat16)."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= size - 8:
                raise S2DError(f"{path} is not a safetensors file (bad header); re-download it")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise S2DError(f"{path} has a corrupt safetensors header; re-download it")
        if not isinstance(header, dict):
            raise S2DError(f"{path} has a corrupt safetensors header (not a JSON object); "
                           f"re-download it")
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.entries = header
        for name, e in header.items():
            if not self._entry_fits(e, size):
                raise S2DError(f"{path}: tensor {name} is truncated or its header entry "
                               f"(dtype, shape, data_offsets) is damaged; re-download the file")

    def _entry_fits(self, e, size: int) -> bool:
        """A header entry is {dtype, shape: [ints], data_offsets: [start, end]} whose bytes
        lie inside the file."""
        if not isinstance(e, dict):
            return False
        dtype, shape = _ST_DTYPES.get(e.get("dtype")), e.get("shape")
        offsets = e.get("data_offsets")
        if dtype is None or not _counts(shape) or not _counts(offsets) or len(offsets) != 2:
            return False
        start, end = offsets
        return (end - start == math.prod(shape) * np.dtype(dtype).itemsize
                and self.data_start + end <= size)

    def keys(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        e = self.entries[name]
        return np.memmap(self.path, dtype=_ST_DTYPES[e["dtype"]], mode="r",
                         offset=self.data_start + e["data_offsets"][0], shape=tuple(e["shape"]))


class _TorchBinFile:
    """`pytorch_model*.bin` via torch.load (memory-mapped when the file allows)."""

    def __init__(self, path: str):
        try:
            import torch
        except ImportError:
            raise S2DError(f"{path} is a PyTorch file and torch is not installed; "
                           f"pip install torch, or use a safetensors checkpoint")
        self.torch = torch
        try:
            try:
                self.sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):  # legacy (non-zip) files cannot be mapped
                    raise
                self.sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many types for a damaged file
            raise S2DError(f"cannot read {path} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                           f"re-download it")
        if not isinstance(self.sd, dict):
            raise S2DError(f"{path} does not hold a state dict; pass an HF model directory")

    def keys(self):
        return self.sd.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.sd[name].shape)

    def get(self, name: str) -> np.ndarray:
        t = self.sd[name].detach()
        if t.dtype == self.torch.bfloat16:
            return t.view(self.torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()


class WeightSource:
    """All tensors of an HF model directory by name, whatever the file layout."""

    LAYOUTS = (("model.safetensors.index.json", _SafetensorsFile),
               ("model.safetensors", _SafetensorsFile),
               ("pytorch_model.bin.index.json", _TorchBinFile),
               ("pytorch_model.bin", _TorchBinFile))

    def __init__(self, model_dir: str):
        self._readers: dict[str, object] = {}
        for fname, reader in self.LAYOUTS:
            path = os.path.join(model_dir, fname)
            if os.path.isfile(path):
                self._reader_cls = reader
                if fname.endswith(".index.json"):
                    self.name_to_file = self._read_index(path, model_dir)
                else:
                    self.name_to_file = {k: path for k in self._open(path).keys()}
                return
        raise S2DError(f"no weights in {model_dir}: expected model.safetensors(.index.json) or "
                       f"pytorch_model.bin(.index.json)")

    @staticmethod
    def _read_index(path: str, model_dir: str) -> dict[str, str]:
        try:
            weight_map = read_json(path, "weight index")["weight_map"]
            weight_map.items()
        except (KeyError, TypeError, AttributeError):
            raise S2DError(f"{path} is not a valid weight index (no weight_map); re-download it")
        files = {n: os.path.join(model_dir, f) for n, f in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not os.path.isfile(shard):
                raise S2DError(f"weight shard {shard} listed in {path} is missing; download it")
        return files

    def _open(self, path: str):
        if path not in self._readers:
            self._readers[path] = self._reader_cls(path)
        return self._readers[path]

    def names(self):
        return self.name_to_file.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._open(self.name_to_file[name]).shape(name)

    def get(self, name: str) -> np.ndarray:
        return self._open(self.name_to_file[name]).get(name)


def write_safetensors(tensors: dict[str, np.ndarray], path: str) -> None:
    specs = {n: TensorSpec(dtype=x.dtype.name, shape=x.shape, data_ptr=x.ctypes.data,
                           data_len=x.nbytes) for n, x in tensors.items()}
    serialize_file(specs, path, metadata={"format": "pt"})  # transformers requires "format"
