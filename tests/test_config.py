"""DS4Config: metadata round trips (in memory and through a GGUF file), refusals, per-layer RoPE."""

import math

import pytest
from gguf import GGUFReader, GGUFWriter

from ds4_app.engine.config import ARCH, ConfigError, DS4Config
from ds4_app.engine.gguf_file import _field_value
from ds4_app.engine.presets import PRESETS, flash, preset, tiny
from ds4_app.engine.synth import add_metadata


def _kv(cfg: DS4Config) -> dict:
    return {k: v for k, v, _ in cfg.metadata_items()}


@pytest.mark.parametrize("name", list(PRESETS))
def test_metadata_round_trip(name):
    cfg = preset(name)
    assert DS4Config.from_metadata(_kv(cfg)) == cfg


@pytest.mark.parametrize("name", list(PRESETS))
def test_metadata_round_trip_through_gguf(tmp_path, name):
    # float32 keys (1e-6, 1.5, ...) come back as the values written, so configs compare equal
    cfg = preset(name)
    path = tmp_path / "meta.gguf"
    w = GGUFWriter(path, ARCH)
    for key, value, kind in cfg.metadata_items():
        if key != "general.architecture":
            add_metadata(w, key, value, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = GGUFReader(path)
    kv = {k: _field_value(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert isinstance(kv[f"{ARCH}.attention.compress_ratios"], list)
    assert kv[f"{ARCH}.attention.layer_norm_rms_epsilon"] == 1e-6
    assert kv[f"{ARCH}.expert_weights_norm"] is True
    assert DS4Config.from_metadata(kv) == cfg


def test_qat_flag_round_trip():
    import dataclasses

    cfg = dataclasses.replace(tiny(), qat_numerics=True)
    kv = _kv(cfg)
    assert kv["ds4app.qat_numerics"] is True
    assert DS4Config.from_metadata(kv).qat_numerics


def test_mtp_blocks_are_not_trunk_layers():
    import dataclasses

    cfg = dataclasses.replace(flash(4), n_nextn=1)
    kv = _kv(cfg)
    assert kv[f"{ARCH}.block_count"] == 5
    back = DS4Config.from_metadata(kv)
    assert back.n_layer == 4 and back.n_nextn == 1 and back == cfg


@pytest.mark.parametrize("edit, needle", [
    (lambda kv: kv.update({"general.architecture": "llama"}), "general.architecture"),
    (lambda kv: kv.pop(f"{ARCH}.rope.scaling.type"), f"{ARCH}.rope.scaling.type"),
    (lambda kv: kv.pop(f"{ARCH}.attention.key_length"), f"{ARCH}.attention.key_length"),
    (lambda kv: kv.update({f"{ARCH}.attention.compress_ratios": [0, 4, 2, 4]}), "compress_ratios[2] = 2"),
    (lambda kv: kv.update({f"{ARCH}.attention.head_count_kv": 4}), "head_count_kv"),
    (lambda kv: kv.update({f"{ARCH}.expert_gating_func": 3}), "expert_gating_func"),
    (lambda kv: kv.update({f"{ARCH}.swiglu_clamp_exp": [10.0] * 3}), "swiglu_clamp_exp has 3 entries"),
    (lambda kv: kv.update({f"{ARCH}.attention.compress_ratios": [0, 4]}), "compress_ratios has 2 entries"),
])
def test_refusals_name_the_key(edit, needle):
    kv = _kv(tiny())
    edit(kv)
    with pytest.raises(ConfigError) as exc:
        DS4Config.from_metadata(kv)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_scalar_swiglu_clamp_applies_to_every_layer():
    kv = _kv(tiny())
    kv[f"{ARCH}.swiglu_clamp_exp"] = 7.0
    kv.pop(f"{ARCH}.swiglu_clamp_shexp")
    cfg = DS4Config.from_metadata(kv)
    assert cfg.swiglu_clamp_exp == (7.0,) * 4 and cfg.swiglu_clamp_shexp == (7.0,) * 4


def test_yarn_ramp_endpoints_on_compressed_layers():
    # base 160000, L0 65536, beta 32/1, 64 RoPE dims: ramp from dim pair 15 (untouched) to 25 (/16)
    cfg = flash(4)
    rope = cfg.rope(2)
    assert (rope.base, rope.yarn_factor, rope.orig_ctx) == (160000.0, 16.0, 65536)
    inv = rope.inv_freqs(64)
    theta = [160000.0 ** (-2.0 * k / 64) for k in range(32)]
    for k in range(32):
        if k <= 15:
            assert inv[k] == pytest.approx(theta[k], rel=1e-12), k
        elif k >= 25:
            assert inv[k] == pytest.approx(theta[k] / 16.0, rel=1e-12), k
        else:
            assert theta[k] / 16.0 < inv[k] < theta[k], k
    # the interpolation is linear in k between the endpoints
    ramp = (20 - 15) / (25 - 15)
    assert inv[20] == pytest.approx(theta[20] / 16 * ramp + theta[20] * (1 - ramp), rel=1e-12)


def test_no_yarn_on_sliding_only_layers():
    cfg = flash(4)
    assert cfg.compress_ratios[0] == 0
    rope = cfg.rope(0)
    assert rope.base == 10000.0 and rope.yarn_factor == 1.0
    assert rope.inv_freqs(64) == pytest.approx([10000.0 ** (-2.0 * k / 64) for k in range(32)], rel=1e-12)


def test_orig_ctx_moves_the_ramp():
    # spec §11.2: defaulting original_context_length to context_length moves the ramp to [22, 33]
    import dataclasses

    rope = dataclasses.replace(flash(4), yarn_orig_ctx=1048576).rope(2)
    inv = rope.inv_freqs(64)
    theta = [160000.0 ** (-2.0 * k / 64) for k in range(32)]
    assert inv[22] == pytest.approx(theta[22], rel=1e-12)
    assert inv[21] == pytest.approx(theta[21], rel=1e-12)
    assert inv[23] < theta[23]
    assert not math.isclose(inv[31], theta[31])
