"""Reading and validating a DS4 GGUF model file.

``ModelFile.open`` memory-maps the file through ``gguf.GGUFReader`` (nothing is read into RAM up
front), builds the ``DS4Config`` from the metadata and checks every trunk tensor of
``tensors.tensor_specs`` for presence, shape and type. Every problem becomes one
``ModelFileError`` line naming the key or tensor (style.md §11); the CLI prints it without a
traceback.
"""

from __future__ import annotations

import collections
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField
from gguf.quants import dequantize

from .config import ARCH, ConfigError, DS4Config
from .tensors import GgmlShape, TensorSpec, is_mtp_tensor, tensor_specs, type_name

GGUF_MAGIC_BYTES = b"GGUF"


class ModelFileError(Exception):
    """A model file we cannot use; the message is one line naming the file's problem."""


@dataclass(frozen=True, slots=True)
class TensorInfo(GgmlShape):
    """Where one tensor lies in the file: type, ggml shape, absolute byte offset and size."""

    name: str
    ggml_type: int
    type_name: str
    ne: tuple[int, ...]
    offset: int
    nbytes: int


def format_bytes(n: float) -> str:
    """Binary units, one decimal: ``12.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class _CheckedReader(GGUFReader):
    """GGUFReader that checks each tensor's type id and extent before building its view.

    The stock reader fails on a truncated file or an unknown type id with a numpy reshape error
    or a bare enum ValueError; here both become a ModelFileError that names the tensor.
    """

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        file_size = len(self.data)
        extents = []
        for field in fields:
            _nlen, name_data, _ndims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            raw = int(raw_dtype[0])
            try:
                qtype = GGMLQuantizationType(raw)
            except ValueError:
                raise ModelFileError(f"tensor {name} has unknown ggml type id {raw}") from None
            if qtype not in GGML_QUANT_SIZES:
                raise ModelFileError(f"tensor {name} has unsupported type {qtype.name}")
            block, size = GGML_QUANT_SIZES[qtype]
            ne = [int(x) for x in dims]
            if ne and ne[0] % block:
                raise ModelFileError(f"tensor {name} has type {qtype.name} but rows of {ne[0]} elements, "
                                     f"not a multiple of its block size {block}")
            start = start_offs + int(offset_tensor[0])
            extents.append((start, start + math.prod(ne) // block * size, name))
        if extents:
            last_end = max(end for _, end, _ in extents)
            if last_end > file_size:
                first_cut = min((e for e in extents if e[1] > file_size), key=lambda e: e[0])
                raise ModelFileError(f"model file truncated at tensor {first_cut[2]}: expected "
                                     f"{format_bytes(last_end - file_size)} more")
        super()._build_tensors(start_offs, fields)


def _f32_value(x: Any) -> float:
    # A float32 key read back as the shortest decimal that round-trips in float32, so 1e-6
    # written by a converter reads as 1e-6 and not 9.99999997e-07 (configs then compare equal).
    return float(str(np.float32(x)))


def _field_value(field: ReaderField) -> Any:
    """A metadata field as a plain Python value (str, int, float, bool or a list of them)."""
    types = field.types
    if not types:
        return None
    main = types[0]
    if main == GGUFValueType.ARRAY:
        if len(types) < 2 or not field.data:
            return []
        sub = types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if sub == GGUFValueType.ARRAY:
            raise ModelFileError(f"metadata key {field.name}: nested arrays are not supported")
        vals = np.concatenate([field.parts[i] for i in field.data])
        if sub == GGUFValueType.FLOAT32:
            return [_f32_value(x) for x in vals]
        if sub == GGUFValueType.BOOL:
            return [bool(x) for x in vals]
        return vals.tolist()
    if main == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    val = field.parts[-1][0]
    if main == GGUFValueType.BOOL:
        return bool(val)
    if main == GGUFValueType.FLOAT32:
        return _f32_value(val)
    return val.item()


class ModelFile:
    """An opened, validated DS4 GGUF: config, metadata, tensor table and memory-mapped data.

    ``tensors`` holds the trunk tensors (those ``tensor_specs`` names); MTP tensors a file may
    carry are in ``extra_tensors`` and are not used. Weight statistics count trunk tensors only.
    """

    __slots__ = ("path", "config", "metadata", "tokenizer_metadata", "tensors", "extra_tensors",
                 "specs", "file_size", "_reader")

    def __init__(self, path: Path, reader: GGUFReader, config: DS4Config, metadata: dict[str, Any],
                 tensors: dict[str, TensorInfo], extra: dict[str, TensorInfo], specs: list[TensorSpec]):
        self.path = path
        self._reader = reader
        self.config = config
        self.metadata = metadata
        self.tokenizer_metadata = {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}
        self.tensors = tensors
        self.extra_tensors = extra
        self.specs = specs
        self.file_size = len(reader.data)

    # --- opening ------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "ModelFile":
        """Open and validate ``path``; any problem is a one-line ModelFileError."""
        p = Path(path)
        if not p.exists():
            raise ModelFileError(f"model file not found: {p}")
        if not p.is_file():
            raise ModelFileError(f"model path is not a file: {p}")
        try:
            with open(p, "rb") as f:
                head = f.read(8)
        except OSError as e:
            raise ModelFileError(f"cannot read model file {p}: {e.strerror or e}") from None
        if head[:4] != GGUF_MAGIC_BYTES:
            raise ModelFileError(f"{p} is not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC_BYTES!r})")
        if len(head) < 8:
            raise ModelFileError(f"model file {p} truncated in its header")
        try:
            reader = _CheckedReader(p, "r")
        except ModelFileError as e:
            raise ModelFileError(f"{e} ({p})") from None
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError,
                OSError) as e:
            # A header cut short makes the reader index past the map; corrupt bytes give bad
            # enum values or impossible lengths. Either way the header cannot be trusted.
            raise ModelFileError(f"model file {p} is truncated or corrupt in its header "
                                 f"({type(e).__name__}: {_one_line(e)})") from None
        try:
            metadata = {name: _field_value(f) for name, f in reader.fields.items()
                        if not name.startswith("GGUF.")}
        except ModelFileError:
            raise
        except (ValueError, UnicodeDecodeError, IndexError) as e:
            raise ModelFileError(f"model file {p} has corrupt metadata ({_one_line(e)})") from None

        arch = metadata.get("general.architecture")
        if arch != ARCH:
            raise ModelFileError(f"{p} is not a DeepSeek-V4 model: general.architecture is {arch!r}, "
                                 f"expected {ARCH!r}")
        try:
            config = DS4Config.from_metadata(metadata)
        except ConfigError as e:
            raise ModelFileError(f"bad model metadata in {p.name}: {_one_line(e)}") from None
        except (ValueError, TypeError) as e:
            raise ModelFileError(f"bad model metadata in {p.name}: {_one_line(e)}") from None

        specs = tensor_specs(config)
        found = {t.name: t for t in reader.tensors}
        tensors: dict[str, TensorInfo] = {}
        for spec in specs:
            rt = found.pop(spec.name, None)
            if rt is None:
                raise ModelFileError(f"missing tensor {spec.name} in {p.name}")
            ne = tuple(int(x) for x in rt.shape)
            if ne != spec.ne:
                raise ModelFileError(f"tensor {spec.name} has shape {list(ne)} (ggml ne), "
                                     f"expected {list(spec.ne)}")
            problem = spec.type_problem(int(rt.tensor_type))
            if problem:
                raise ModelFileError(problem)
            tensors[spec.name] = _info(rt)
        extra: dict[str, TensorInfo] = {}
        for name, rt in found.items():
            if not is_mtp_tensor(name, config):
                raise ModelFileError(f"unexpected tensor {name} in {p.name} (not a DS4 trunk or MTP tensor)")
            extra[name] = _info(rt)
        return cls(p, reader, config, metadata, tensors, extra, specs)

    # --- data ---------------------------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        """A trunk tensor's TensorInfo; KeyError names it when absent."""
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"no trunk tensor {name} in {self.path.name}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the memory map (no copy)."""
        t = self.info(name)
        return self._reader.data[t.offset:t.offset + t.nbytes]

    def tensor_f32(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32 with numpy shape = reversed ne (I32 stays int32).

        F32 tensors come back as a read-only view of the map; every other type is a new array.
        """
        t = self.info(name)
        raw = self.raw(name)
        if t.ggml_type == GGMLQuantizationType.I32:
            return raw.view(np.int32).reshape(t.shape)
        if t.ggml_type == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(t.shape)
        rows = raw.reshape(-1, raw.size // max(1, math.prod(t.ne[1:])))
        out = dequantize(rows, GGMLQuantizationType(t.ggml_type))
        return np.asarray(out, dtype=np.float32).reshape(t.shape)

    def weights_f32(self) -> dict[str, np.ndarray]:
        """Every trunk tensor dequantized (for the numpy reference; tiny models only)."""
        return {name: self.tensor_f32(name) for name in self.tensors}

    @property
    def weight_bytes(self) -> int:
        """Bytes of all trunk tensors as stored."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def param_count(self) -> int:
        """Number of trunk weights."""
        return sum(t.n_elements for t in self.tensors.values())

    def type_counts(self) -> dict[str, int]:
        """How many trunk tensors are stored in each type, by type name."""
        return dict(sorted(collections.Counter(t.type_name for t in self.tensors.values()).items()))

    def close(self) -> None:
        """Drop this object's references to the memory map (views handed out keep it alive)."""
        self._reader = None  # type: ignore[assignment]

    def __enter__(self) -> "ModelFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _info(rt: Any) -> TensorInfo:
    return TensorInfo(name=rt.name, ggml_type=int(rt.tensor_type), type_name=type_name(int(rt.tensor_type)),
                      ne=tuple(int(x) for x in rt.shape), offset=int(rt.data_offset), nbytes=int(rt.n_bytes))


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
