"""Shared test setup: the repo root on sys.path, markers, and common fixtures."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests on machines without a CUDA/HIP build and device."""
    try:
        from ds4_app.engine import _native  # noqa: F401

        has_gpu = bool(getattr(_native, "gpu_available", lambda: False)())
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a GPU build (DS4_GPU=cuda|hip) and a device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not the tests/gpu folder name
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A synthetic tiny-preset DS4 GGUF (seed 1), written once per test worker."""
    from ds4_app.engine.synth import synthesize

    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    synthesize("tiny", str(path), seed=1)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path):
    """The tiny model file, opened."""
    from ds4_app.engine.gguf_file import ModelFile

    return ModelFile.open(tiny_model_path)
