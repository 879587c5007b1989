"""Deterministic random DS4 GGUFs, written straight in their quantized types.

``synthesize`` writes every tensor of ``tensors.tensor_specs`` with the upstream key and tensor
names (spec §11.2/11.3), through ``gguf.GGUFWriter``'s generic key/value API. Tensors stream to
disk chunk by chunk (the ``flash`` preset is ~160 GB): the quantized blocks are generated directly
from the RNG, never quantized from a float copy. The same seed gives a byte-identical file: each
tensor draws from its own generator seeded by (seed, crc32(name)) in fixed-size chunks.

Value statistics keep activations finite and varied through the whole model: matrices have mean
0 and std 1/sqrt(fan_in) (fan_in = ne[0]) whatever their storage type; norms are 1 +- 0.1; sinks
N(0, 1); mHC scales U(0.5, 1.5) * 0.1 and small bases; small ape and router bias; the hash
routing table gives every token ``n_expert_used`` distinct experts.

Quantized block layouts (ggml): Q8_0 = f16 d + 32 int8; Q4_K = f16 d, f16 dmin, 12 bytes of
packed 6-bit scales/mins, 128 nibble bytes (value = d*sc*q - dmin*m); MXFP4 = E8M0 byte + 16
nibble bytes (value = kvalue[q] * 2^(e-128), ggml's half-scaled E8M0).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

from .config import ARCH, DS4Config
from .presets import preset as preset_config
from .tensors import TensorSpec, parse_type, tensor_nbytes, tensor_specs

T = GGMLQuantizationType
CHUNK_BYTES = 32 << 20  # generation/write unit; part of the byte-exact output, do not change lightly

# Roles group tensors that share a storage type in a mix (spec §11.3's DS4 q4 column).
ROLES = ("embd", "output", "attn", "compressor", "compressor_ape", "indexer", "indexer_ape", "router",
         "hc_fn", "output_hc_fn", "exps_gate_up", "exps_down", "shexp", "vector", "tid2eid")

# DS4's q4 files (spec §11.3); a file upstream llama.cpp loads.
DS4_Q4_TYPES: dict[str, int] = {
    "embd": T.F16, "output": T.Q8_0, "attn": T.Q8_0, "compressor": T.F16, "compressor_ape": T.F16,
    "indexer": T.F16, "indexer_ape": T.F16, "router": T.F16, "hc_fn": T.F16, "output_hc_fn": T.F16,
    "exps_gate_up": T.Q4_K, "exps_down": T.Q4_K, "shexp": T.Q8_0, "vector": T.F32, "tid2eid": T.I32,
}

# The test mix: every supported storage type appears at least once.
TINY_TYPES: dict[str, int] = {
    "embd": T.F16, "output": T.Q8_0, "attn": T.Q8_0, "compressor": T.BF16, "compressor_ape": T.BF16,
    "indexer": T.F16, "indexer_ape": T.F32, "router": T.F32, "hc_fn": T.F16, "output_hc_fn": T.F32,
    "exps_gate_up": T.Q4_K, "exps_down": T.MXFP4, "shexp": T.Q8_0, "vector": T.F32, "tid2eid": T.I32,
}

PRESET_TYPES: dict[str, dict[str, int]] = {"tiny": TINY_TYPES, "flash-l4": DS4_Q4_TYPES, "flash": DS4_Q4_TYPES}

_ATTN = ("attn_q_a.weight", "attn_q_b.weight", "attn_kv.weight", "attn_output_a.weight", "attn_output_b.weight")


def tensor_role(spec: TensorSpec) -> str:
    """The mix role of a trunk tensor (one of ROLES)."""
    n = spec.name
    short = n.split(".", 2)[2] if n.startswith("blk.") else n
    if spec.kind == "f32":
        return "vector"
    if spec.kind == "i32":
        return "tid2eid"
    if n == "token_embd.weight":
        return "embd"
    if n == "output.weight":
        return "output"
    if n == "output_hc_fn.weight":
        return "output_hc_fn"
    if short in ("hc_attn_fn.weight", "hc_ffn_fn.weight"):
        return "hc_fn"
    if short in _ATTN:
        return "attn"
    if short == "attn_compressor_ape.weight":
        return "compressor_ape"
    if short.startswith("attn_compressor_"):
        return "compressor"
    if short == "indexer_compressor_ape.weight":
        return "indexer_ape"
    if short.startswith("indexer"):
        return "indexer"
    if short == "ffn_gate_inp.weight":
        return "router"
    if short in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
        return "exps_gate_up"
    if short == "ffn_down_exps.weight":
        return "exps_down"
    if "_shexp." in short:
        return "shexp"
    raise AssertionError(f"no role for tensor {n}")


def resolve_config(preset_or_config: str | DS4Config) -> tuple[DS4Config, dict[str, int], str]:
    """(config, base type mix, name) for a preset name or a config (which gets the test mix)."""
    if isinstance(preset_or_config, DS4Config):
        return preset_or_config, TINY_TYPES, "custom"
    cfg = preset_config(preset_or_config)  # ValueError names the choices
    return cfg, PRESET_TYPES[preset_or_config], preset_or_config


def tensor_types(cfg: DS4Config, base: dict[str, int],
                 overrides: dict[str, str | int] | None = None) -> dict[str, GGMLQuantizationType]:
    """The storage type of every trunk tensor.

    ``base`` maps roles to types. ``overrides`` keys are role names or tensor-name patterns
    (fnmatch, e.g. ``"blk.*.ffn_down_exps.weight"``); a pattern beats a role. Where the mix's
    block type does not divide a matrix row (small custom configs) the tensor falls back to F16.
    An override the tensor's kind forbids is a ValueError.
    """
    overrides = dict(overrides or {})
    for key in overrides:
        if key not in ROLES and not any(ch in key for ch in "*?[") and "." not in key:
            raise ValueError(f"types override {key!r} is neither a role ({', '.join(ROLES)}) nor a tensor name")
    out: dict[str, GGMLQuantizationType] = {}
    for spec in tensor_specs(cfg):
        role = tensor_role(spec)
        chosen: GGMLQuantizationType | None = None
        for key, val in overrides.items():
            if key not in ROLES and fnmatch.fnmatchcase(spec.name, key):
                chosen = parse_type(val)
        if chosen is None and role in overrides:
            chosen = parse_type(overrides[role])
        if chosen is not None:
            problem = spec.type_problem(chosen)
            if problem:
                raise ValueError(f"types override: {problem}")
        else:
            chosen = T(base[role])
            if spec.type_problem(chosen):
                chosen = T.F16
        out[spec.name] = chosen
    return out


# --- value generators -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class _Dist:
    """What the dequantized values should look like: normal(mean, std) or uniform(lo, hi)."""

    kind: str  # "normal" | "uniform"
    a: float
    b: float


def _dist_for(spec: TensorSpec) -> _Dist:
    short = spec.name.split(".", 2)[2] if spec.name.startswith("blk.") else spec.name
    if spec.kind == "matrix" or short.endswith("_fn.weight"):  # matrices and mHC fn
        return _Dist("normal", 0.0, 1.0 / math.sqrt(spec.ne[0]))
    if "ape" in short:
        return _Dist("normal", 0.0, 0.05)
    if "norm" in short:
        return _Dist("uniform", 0.9, 1.1)
    if short == "attn_sinks.weight":
        return _Dist("normal", 0.0, 1.0)
    if short.endswith("_scale.weight"):
        return _Dist("uniform", 0.05, 0.15)
    if short.endswith("_base.weight"):
        return _Dist("normal", 0.0, 0.05)
    if short == "exp_probs_b.bias":
        return _Dist("normal", 0.0, 0.05)
    raise AssertionError(f"no value distribution for tensor {spec.name}")


_U_RMS = math.sqrt(13.0 / 12.0)  # sqrt(E[u^2]) for u ~ U(0.5, 1.5), the per-block scale jitter
_Q8_RMS = math.sqrt((255.0 ** 2 - 1.0) / 12.0)  # std of int8 uniform on -127..127
# Q4_K: sub-block scale sc ~ U{8..31}, min m = sc + delta, delta ~ U{-3..3}, dmin = 7.5 d, so
# value = d*(sc*(q - 7.5) + 7.5*(sc - m)) has mean 0; m != sc keeps a scale/min mix-up visible.
_Q4K_SC = (8, 31)
_Q4K_DELTA = 3
_Q4K_RMS = math.sqrt(
    (((_Q4K_SC[1] + _Q4K_SC[0]) / 2) ** 2 + ((_Q4K_SC[1] - _Q4K_SC[0] + 1) ** 2 - 1) / 12) * (16 ** 2 - 1) / 12
    + 7.5 ** 2 * ((2 * _Q4K_DELTA + 1) ** 2 - 1) / 12)
_MXFP4_MS = 548.0 / 16.0  # mean square of ggml's doubled e2m1 levels over the 16 codes


def _gen_float(rng: np.random.Generator, n: int, dist: _Dist) -> np.ndarray:
    if dist.kind == "uniform":
        return rng.uniform(dist.a, dist.b, n).astype(np.float32)
    x = rng.standard_normal(n, dtype=np.float32)
    x *= np.float32(dist.b)
    if dist.a:
        x += np.float32(dist.a)
    return x


def _to_bf16(x: np.ndarray) -> np.ndarray:
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def _block_scale(rng: np.random.Generator, nb: int, std: float, unit_rms: float) -> np.ndarray:
    # per-block jitter so a dequantizer that reads the wrong block's scale shows up in tests
    return (std / (unit_rms * _U_RMS)) * rng.uniform(0.5, 1.5, nb)


def _gen_q8_0(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    nb = n // 32
    out = np.empty((nb, 34), dtype=np.uint8)
    out[:, :2] = _block_scale(rng, nb, std, _Q8_RMS).astype(np.float16).view(np.uint8).reshape(nb, 2)
    out[:, 2:] = rng.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
    return out


def _gen_q4_k(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    nb = n // 256
    out = rng.integers(0, 256, (nb, 144), dtype=np.uint8)  # the nibbles (bytes 16..) stay random
    d = _block_scale(rng, nb, std, _Q4K_RMS)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = (7.5 * d).astype(np.float16).view(np.uint8).reshape(nb, 2)
    sc = rng.integers(_Q4K_SC[0], _Q4K_SC[1] + 1, (nb, 8), dtype=np.uint8)
    m = (sc.astype(np.int16) + rng.integers(-_Q4K_DELTA, _Q4K_DELTA + 1, (nb, 8), dtype=np.int16)).astype(np.uint8)
    # ggml get_scale_min_k4 packing: bytes 0-3 sc[0..3] | hi2(sc[4..7]) << 6, bytes 4-7 the same for
    # the mins, bytes 8-11 lo4(sc[4..7]) | lo4(m[4..7]) << 4
    out[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _gen_mxfp4(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    nb = n // 32
    out = rng.integers(0, 256, (nb, 17), dtype=np.uint8)
    # power-of-two scales: mix exponents a and a+1 so E[scale^2] * mean(k^2) = std^2 exactly
    s2 = std * std / _MXFP4_MS
    a = math.floor(math.log2(s2) / 2)
    p = (s2 / 4.0 ** a - 1.0) / 3.0
    e = 128 + a + (rng.random(nb) < p)
    out[:, 0] = np.clip(e, 2, 254).astype(np.uint8)
    return out


def _gen_tid2eid(rng: np.random.Generator, rows: int, n_expert: int, k: int) -> np.ndarray:
    # k distinct experts per token: the k smallest of n_expert uniform draws
    r = rng.random((rows, n_expert), dtype=np.float32)
    return np.argpartition(r, k - 1, axis=1)[:, :k].astype(np.int32)


def _chunks(spec: TensorSpec, qtype: int, seed: int, n_expert: int) -> Iterator[np.ndarray]:
    """The tensor's bytes as a sequence of C-contiguous arrays, CHUNK_BYTES at a time."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(spec.name.encode())])))
    row = spec.ne[0]
    rows = math.prod(spec.ne[1:])
    row_bytes = tensor_nbytes(qtype, (row,))
    step = max(1, CHUNK_BYTES // row_bytes)
    dist = _dist_for(spec) if qtype != T.I32 else None
    for r0 in range(0, rows, step):
        nr = min(step, rows - r0)
        n = nr * row
        if qtype == T.I32:
            yield _gen_tid2eid(rng, nr, n_expert, row)
        elif qtype == T.F32:
            yield _gen_float(rng, n, dist)
        elif qtype == T.F16:
            yield _gen_float(rng, n, dist).astype(np.float16)
        elif qtype == T.BF16:
            yield _to_bf16(_gen_float(rng, n, dist))
        else:
            if dist.kind != "normal" or dist.a != 0.0:
                raise ValueError(f"tensor {spec.name}: quantized synthesis needs zero-mean values")
            gen = {T.Q8_0: _gen_q8_0, T.Q4_K: _gen_q4_k, T.MXFP4: _gen_mxfp4}.get(T(qtype))
            if gen is None:
                raise ValueError(f"tensor {spec.name}: cannot synthesize type {T(qtype).name}")
            yield gen(rng, n, dist.b)


class _StreamedTensor:
    """Stands in for a numpy array in GGUFWriter: ``tofile`` generates and writes chunk by chunk."""

    __slots__ = ("nbytes", "_make", "_progress")

    def __init__(self, nbytes: int, make: Callable[[], Iterator[np.ndarray]],
                 progress: Callable[[int], None] | None) -> None:
        self.nbytes = nbytes
        self._make = make
        self._progress = progress

    def tofile(self, fout: Any) -> None:
        written = 0
        for chunk in self._make():
            buf = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
            fout.write(buf.data)
            written += buf.nbytes
            if self._progress:
                self._progress(buf.nbytes)
        if written != self.nbytes:
            raise AssertionError(f"synthesized {written} bytes, expected {self.nbytes}")


_VALUE_TYPES = {"string": GGUFValueType.STRING, "uint32": GGUFValueType.UINT32, "int32": GGUFValueType.INT32,
                "float32": GGUFValueType.FLOAT32, "bool": GGUFValueType.BOOL}
_ARRAY_TYPES = {"string_array": GGUFValueType.STRING, "int32_array": GGUFValueType.INT32,
                "uint32_array": GGUFValueType.UINT32, "float32_array": GGUFValueType.FLOAT32}


def add_metadata(writer: GGUFWriter, key: str, value: Any, kind: str) -> None:
    """Write one (key, value, kind) item of ``metadata_items()`` through the generic KV API."""
    if kind in _VALUE_TYPES:
        writer.add_key_value(key, value, _VALUE_TYPES[kind])
    elif kind in _ARRAY_TYPES:
        if len(value) == 0:
            raise ValueError(f"metadata {key}: GGUF writer cannot store an empty array")
        writer.add_key_value(key, list(value), GGUFValueType.ARRAY, sub_type=_ARRAY_TYPES[kind])
    else:
        raise ValueError(f"metadata {key}: unknown value kind {kind!r}")


def estimate_file_size(preset_or_config: str | DS4Config, types: dict[str, str | int] | None = None) -> int:
    """Bytes of tensor data a synthesized file will hold (metadata adds a few MB at most)."""
    cfg, base, _ = resolve_config(preset_or_config)
    qtypes = tensor_types(cfg, base, types)
    return sum(GGUFWriter.ggml_pad(tensor_nbytes(qtypes[s.name], s.ne), 32) for s in tensor_specs(cfg))


def synthesize(preset_or_config: str | DS4Config, path: str | os.PathLike[str], *, seed: int,
               types: dict[str, str | int] | None = None, tokenizer: Any = None, qat_numerics: bool = False,
               progress: Callable[[int, int], None] | None = None) -> None:
    """Write a deterministic random DS4 GGUF of a preset (or config) to ``path``.

    ``types`` overrides storage types (see ``tensor_types``); ``tokenizer`` is a TokenizerData
    (default: the synthetic vocabulary of ``n_vocab`` tokens); ``qat_numerics`` writes
    ``ds4app.qat_numerics = true``. ``progress(done_bytes, total_bytes)`` is called per chunk.
    The file appears only when complete (written as ``path.partial``, then renamed).
    ValueError for bad arguments or too little disk space.
    """
    cfg, base, name = resolve_config(preset_or_config)
    if qat_numerics:
        cfg = dataclasses.replace(cfg, qat_numerics=True)
    qtypes = tensor_types(cfg, base, types)
    specs = tensor_specs(cfg)
    if tokenizer is None:
        from .tokenizer import build_synthetic_vocab

        tokenizer = build_synthetic_vocab(cfg.n_vocab)
    if len(tokenizer.tokens) != cfg.n_vocab:
        raise ValueError(f"tokenizer has {len(tokenizer.tokens)} tokens, the model's vocab_size is {cfg.n_vocab}")

    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"output directory does not exist: {path.parent}")
    sizes = {s.name: tensor_nbytes(qtypes[s.name], s.ne) for s in specs}
    total = sum(sizes.values())
    free = shutil.disk_usage(path.parent).free
    if total > free:
        raise ValueError(f"not enough disk space for {path.name}: needs {total / 2**30:.1f} GiB, "
                         f"{free / 2**30:.1f} GiB free in {path.parent}")

    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(tmp, ARCH)  # writes general.architecture itself
    try:
        writer.add_string("general.name", f"ds4-synth-{name}-seed{seed}")
        writer.add_quantization_version(2)
        for key, value, kind in cfg.metadata_items() + tokenizer.metadata_items():
            if key != "general.architecture":
                add_metadata(writer, key, value, kind)

        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            if progress:
                progress(done[0], total)

        for spec in specs:
            qt = qtypes[spec.name]
            # the float32 dtype tells the writer ``shape`` counts elements, not bytes
            writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), sizes[spec.name], raw_dtype=qt)
            writer.tensors[-1][spec.name].tensor = _StreamedTensor(
                sizes[spec.name],
                lambda spec=spec, qt=qt: _chunks(spec, qt, seed, cfg.n_expert), tick)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
