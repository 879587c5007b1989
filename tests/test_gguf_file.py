"""ModelFile: a synthesized tiny model opens and reads back; every kind of bad file is one line."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from ds4_app.engine.config import ARCH
from ds4_app.engine.gguf_file import ModelFile, ModelFileError
from ds4_app.engine.presets import tiny
from ds4_app.engine.synth import synthesize
from ds4_app.engine.tensors import tensor_specs
from ds4_app.engine.tokenizer import TokenizerData, build_synthetic_vocab

ROOT = Path(__file__).resolve().parents[1]
T = GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    synthesize("tiny", path, seed=7)
    return path


@pytest.fixture(scope="module")
def tiny_file(tiny_path) -> ModelFile:
    return ModelFile.open(tiny_path)


# --- a good file ------------------------------------------------------------------------------

def test_config_and_tensor_table(tiny_file):
    assert tiny_file.config == tiny()
    specs = tensor_specs(tiny())
    assert list(tiny_file.tensors) == [s.name for s in specs]
    assert tiny_file.extra_tensors == {}
    for s in specs:
        info = tiny_file.tensors[s.name]
        assert info.ne == s.ne
        assert info.offset % 32 == 0
    assert tiny_file.param_count == sum(s.n_elements for s in specs)
    assert sum(tiny_file.type_counts().values()) == len(specs)
    assert tiny_file.weight_bytes <= tiny_file.file_size


def test_metadata_is_plain_python(tiny_file):
    md = tiny_file.metadata
    assert md["general.architecture"] == "deepseek4"
    assert md["general.name"] == "ds4-synth-tiny-seed7"
    assert md[f"{ARCH}.block_count"] == 4 and type(md[f"{ARCH}.block_count"]) is int
    assert md[f"{ARCH}.attention.compress_ratios"] == [0, 4, 128, 4]
    assert md[f"{ARCH}.expert_weights_norm"] is True
    assert md[f"{ARCH}.attention.layer_norm_rms_epsilon"] == 1e-6
    assert md[f"{ARCH}.swiglu_clamp_exp"] == [10.0] * 4
    assert all(isinstance(t, str) for t in md["tokenizer.ggml.tokens"])
    assert set(tiny_file.tokenizer_metadata) == {k for k in md if k.startswith("tokenizer.")}


def test_tokenizer_round_trip(tiny_file):
    assert TokenizerData.from_metadata(tiny_file.tokenizer_metadata) == build_synthetic_vocab(1024)


def test_tensor_f32_matches_gguf_reader(tiny_file, tiny_path):
    # an independent read of every tensor through gguf's own views and dequantizers
    reader = GGUFReader(tiny_path)
    theirs = {t.name: t for t in reader.tensors}
    for name, info in tiny_file.tensors.items():
        ours = tiny_file.tensor_f32(name)
        assert ours.shape == tuple(reversed(info.ne)), name
        t = theirs[name]
        assert tiny_file.raw(name).nbytes == info.nbytes == t.n_bytes
        if info.ggml_type == T.I32:
            assert ours.dtype == np.int32
            np.testing.assert_array_equal(ours, t.data)
        else:
            assert ours.dtype == np.float32
            ref = dequantize(np.asarray(t.data), T(info.ggml_type)).reshape(ours.shape)
            np.testing.assert_array_equal(ours, ref, err_msg=name)


def test_weights_f32_covers_the_trunk(tiny_file):
    w = tiny_file.weights_f32()
    assert set(w) == set(tiny_file.tensors)
    assert all(np.isfinite(a).all() for a in w.values())


def test_raw_is_a_read_only_view(tiny_file):
    raw = tiny_file.raw("blk.0.attn_norm.weight")
    assert raw.dtype == np.uint8 and not raw.flags.writeable


# --- bad files --------------------------------------------------------------------------------

def _rewrite(src: Path, dst: Path, *, arch: str = ARCH, drop_keys=(), set_keys=None, drop_tensors=(),
             replace=None, add=None) -> Path:
    """Copy a GGUF with edits: metadata keys dropped/set, tensors dropped/replaced/added.

    ``replace``/``add`` map a tensor name to (array, raw_dtype or None).
    """
    from ds4_app.engine.gguf_file import _field_value

    r = GGUFReader(src)
    w = GGUFWriter(dst, arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        if set_keys and key in set_keys:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, _field_value(f), f.types[0], sub_type=sub)
    for key, (val, vtype) in (set_keys or {}).items():
        w.add_key_value(key, val, vtype)
    replace = replace or {}
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        if t.name in replace:
            arr, raw = replace[t.name]
            w.add_tensor(t.name, arr, raw_dtype=raw)
            continue
        raw_dtype = None if t.tensor_type in (T.F32, T.F16, T.I32) else t.tensor_type
        w.add_tensor(t.name, np.array(t.data), raw_dtype=raw_dtype)
    for name, (arr, raw) in (add or {}).items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _error(path) -> str:
    with pytest.raises(ModelFileError) as exc:
        ModelFile.open(path)
    msg = str(exc.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


def test_missing_file(tmp_path):
    assert "model file not found" in _error(tmp_path / "nope.gguf")


def test_directory(tmp_path):
    assert "not a file" in _error(tmp_path)


def test_wrong_magic(tmp_path, tiny_path):
    data = bytearray(tiny_path.read_bytes())
    data[:4] = b"GGML"
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(bytes(data))
    assert "not a GGUF file" in _error(bad)


def test_empty_file(tmp_path):
    bad = tmp_path / "empty.gguf"
    bad.write_bytes(b"")
    assert "not a GGUF file" in _error(bad)


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.1])
def test_truncated_in_tensor_data(tmp_path, tiny_path, keep):
    data = tiny_path.read_bytes()
    cut = int(len(data) * keep)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    msg = _error(bad)
    assert msg.startswith("model file truncated at tensor ")
    # the named tensor is the first one that does not fit, and it is a real tensor name
    named = msg.split("tensor ", 1)[1].split(":", 1)[0]
    infos = ModelFile.open(tiny_path).tensors
    assert named in infos
    assert infos[named].offset + infos[named].nbytes > cut
    assert all(i.offset + i.nbytes <= cut for i in infos.values() if i.offset < infos[named].offset)
    assert "MiB more" in msg or "KiB more" in msg or "B more" in msg


def test_truncated_in_header(tmp_path, tiny_path):
    bad = tmp_path / "head.gguf"
    bad.write_bytes(tiny_path.read_bytes()[:2000])
    assert "truncated or corrupt in its header" in _error(bad)


def test_wrong_architecture(tmp_path, tiny_path):
    bad = _rewrite(tiny_path, tmp_path / "llama.gguf", arch="llama")
    msg = _error(bad)
    assert "general.architecture is 'llama'" in msg and "deepseek4" in msg


def test_missing_metadata_key(tmp_path, tiny_path):
    bad = _rewrite(tiny_path, tmp_path / "nokey.gguf", drop_keys={f"{ARCH}.rope.scaling.type"})
    assert f"missing metadata key {ARCH}.rope.scaling.type" in _error(bad)


def test_bad_metadata_value(tmp_path, tiny_path):
    bad = _rewrite(tiny_path, tmp_path / "kv.gguf",
                   set_keys={f"{ARCH}.attention.head_count_kv": (4, GGUFValueType.UINT32)})
    assert "head_count_kv" in _error(bad)


def test_missing_tensor(tmp_path, tiny_path):
    bad = _rewrite(tiny_path, tmp_path / "missing.gguf", drop_tensors={"blk.2.attn_kv.weight"})
    assert _error(bad).startswith("missing tensor blk.2.attn_kv.weight")


def test_wrong_shape(tmp_path, tiny_path):
    bad = _rewrite(tiny_path, tmp_path / "shape.gguf",
                   replace={"blk.0.attn_sinks.weight": (np.zeros(5, np.float32), None)})
    msg = _error(bad)
    assert msg == "tensor blk.0.attn_sinks.weight has shape [5] (ggml ne), expected [4]"


def test_unsupported_type(tmp_path, tiny_path):
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    bad = _rewrite(tiny_path, tmp_path / "q5.gguf",
                   replace={"blk.1.attn_q_a.weight": (quantize(w, T.Q5_0), T.Q5_0)})
    msg = _error(bad)
    assert "blk.1.attn_q_a.weight" in msg and "unsupported type Q5_0" in msg


def test_type_not_allowed_for_kind(tmp_path, tiny_path):
    bad = _rewrite(tiny_path, tmp_path / "f16norm.gguf",
                   replace={"blk.0.attn_norm.weight": (np.ones(256, np.float16), None)})
    assert _error(bad) == "tensor blk.0.attn_norm.weight has type F16; it must be F32"


def test_unknown_type_id(tmp_path, tiny_path):
    r = GGUFReader(tiny_path)
    t = next(t for t in r.tensors if t.name == "blk.0.attn_sinks.weight")
    # tensor info = name (u64 length + bytes), n_dims u32, dims u64 each, type u32, offset u64
    type_at = t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)
    data = bytearray(tiny_path.read_bytes())
    assert int.from_bytes(data[type_at:type_at + 4], "little") == int(T.F32)
    data[type_at:type_at + 4] = (200).to_bytes(4, "little")
    bad = tmp_path / "typeid.gguf"
    bad.write_bytes(bytes(data))
    assert "tensor blk.0.attn_sinks.weight has unknown ggml type id 200" in _error(bad)


def test_unexpected_tensor(tmp_path, tiny_path):
    bad = _rewrite(tiny_path, tmp_path / "extra.gguf",
                   add={"blk.9.attn_norm.weight": (np.ones(256, np.float32), None)})
    assert _error(bad).startswith("unexpected tensor blk.9.attn_norm.weight")


def test_mtp_block_is_allowed_and_kept_aside(tmp_path, tiny_path):
    # block_count 5 with one nextn layer: blk.4.* is the MTP block, not a trunk layer
    U32, ARR = GGUFValueType.UINT32, GGUFValueType.ARRAY
    path = _rewrite(tiny_path, tmp_path / "mtp.gguf", set_keys={
        f"{ARCH}.block_count": (5, U32), f"{ARCH}.nextn_predict_layers": (1, U32),
        f"{ARCH}.attention.compress_ratios": ([0, 4, 128, 4, 0], ARR),
        f"{ARCH}.swiglu_clamp_exp": ([10.0] * 5, ARR), f"{ARCH}.swiglu_clamp_shexp": ([10.0] * 5, ARR)},
        add={"blk.4.attn_norm.weight": (np.ones(256, np.float32), None),
             "blk.4.nextn.enorm.weight": (np.ones(256, np.float32), None)})
    mf = ModelFile.open(path)
    assert mf.config == dataclasses.replace(tiny(), n_nextn=1)
    assert set(mf.extra_tensors) == {"blk.4.attn_norm.weight", "blk.4.nextn.enorm.weight"}
    assert "blk.4.attn_norm.weight" not in mf.tensors and len(mf.tensors) == len(tensor_specs(tiny()))


# --- the CLI: bad files exit 2 with one stderr line, no traceback --------------------------------

_HARNESS = """
import argparse, sys
from ds4_app.commands import model
p = argparse.ArgumentParser(prog="ds4-app")
model.register(p.add_subparsers(dest="command"))
a = p.parse_args(sys.argv[1:])
sys.exit(a.handler(a))
"""


def _cli_available() -> bool:
    r = subprocess.run([sys.executable, "-c", "import ds4_app.cli as c; c.build_parser()"], cwd=ROOT,
                       capture_output=True, text=True)
    return r.returncode == 0


def _runners() -> list:
    runs = [pytest.param([sys.executable, "-c", _HARNESS], id="handlers")]
    runs.append(pytest.param([sys.executable, "-m", "ds4_app"], id="main",
                             marks=pytest.mark.skipif(not _cli_available(),
                                                      reason="ds4_app.cli cannot build its parser yet")))
    return runs


@pytest.mark.parametrize("runner", _runners())
def test_cli_inspect_bad_files(tmp_path, tiny_path, runner):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_path.read_bytes()[: tiny_path.stat().st_size // 2])
    notgguf = tmp_path / "text.gguf"
    notgguf.write_text("hello")
    llama = _rewrite(tiny_path, tmp_path / "llama.gguf", arch="llama")
    for path, needle in ((cut, "truncated at tensor"), (notgguf, "not a GGUF file"),
                         (llama, "general.architecture"), (tmp_path / "none.gguf", "not found")):
        r = subprocess.run(runner + ["model", "inspect", str(path)], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 2, (path, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ds4-app: error: ") and needle in lines[0], r.stderr
        assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("runner", _runners())
def test_cli_synth_and_inspect(tmp_path, runner):
    out = tmp_path / "t.gguf"
    r = subprocess.run(runner + ["model", "synth", "--preset", "tiny", "--seed", "7", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert ModelFile.open(out).config == tiny()
    r = subprocess.run(runner + ["model", "inspect", str(out), "--json"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import json

    info = json.loads(r.stdout)
    assert info["config"]["compress_ratios"] == [0, 4, 128, 4]
    assert info["types"] == {"BF16": 9, "F16": 17, "F32": 54, "I32": 1, "MXFP4": 4, "Q4_K": 8, "Q8_0": 33}
    assert info["file_size"] == out.stat().st_size
    import importlib.util

    if importlib.util.find_spec("ds4_app.engine.memory") is None:
        assert info["memory"] is None
    else:
        mem = info["memory"]
        assert mem["max_slots"] == 6 and mem["max_ctx"] == 4096 and mem["n_pages"] > 0
        assert mem["total"] == sum(mem["sections"].values()) > info["weight_bytes"]
    r = subprocess.run(runner + ["model", "inspect", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "types" in r.stdout and "Q4_K 8" in r.stdout


@pytest.mark.parametrize("runner", _runners())
def test_cli_synth_bad_arguments(tmp_path, runner):
    for extra in (["--type", "exps_down=Q5_0"], ["--type", "nonsense"], ["--out", str(tmp_path / "no" / "x.gguf")]):
        args = ["model", "synth", "--preset", "tiny", "--out", str(tmp_path / "x.gguf")] + extra
        r = subprocess.run(runner + args, cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 2, (extra, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ds4-app: error: ") and "Traceback" not in r.stderr
