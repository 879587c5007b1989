"""`ds4-app generate` as a user runs it: a real process, a real model file, JSON out."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["Hello there.", "What is the capital of France?", "Count to five.", "Tell me a joke.",
           "Write a haiku about rain, please."]


def ds4(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ds4_app", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def generate(model, backend, prompts=PROMPTS, *extra):
    args = ["generate", "--model", model, "--backend", backend, "--max-tokens", "10", "--seed", "3", "--json"]
    for p in prompts:
        args += ["--prompt", p]
    res = ds4(*args, *extra)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out) == len(prompts)
    return out


def test_synth_inspect_generate_is_repeatable(tmp_path):
    path = str(tmp_path / "m.gguf")
    assert ds4("model", "synth", "--preset", "tiny", "--seed", "5", "--out", path).returncode == 0
    info = ds4("model", "inspect", path, "--slots", "2", "--ctx", "512")
    assert info.returncode == 0 and "deepseek4" in info.stdout
    a = generate(path, "cpu", PROMPTS[:2], "--temperature", "0.8")
    b = generate(path, "cpu", PROMPTS[:2], "--temperature", "0.8")
    assert [x["tokens"] for x in a] == [x["tokens"] for x in b]
    assert all(len(x["tokens"]) > 0 and x["finish_reason"] in ("stop", "length") for x in a)


def test_cpu_and_reference_give_the_same_greedy_tokens(tiny_model_path):
    cpu = generate(tiny_model_path, "cpu")
    ref = generate(tiny_model_path, "reference")
    assert [x["tokens"] for x in cpu] == [x["tokens"] for x in ref]
    assert [x["text"] for x in cpu] == [x["text"] for x in ref]


@pytest.mark.parametrize("problem", ["missing", "not_gguf", "truncated"])
def test_bad_model_file_is_one_line(tmp_path, tiny_model_path, problem):
    path = tmp_path / "bad.gguf"
    if problem == "not_gguf":
        path.write_bytes(b"hello, this is not a model")
    elif problem == "truncated":
        data = open(tiny_model_path, "rb").read()
        path.write_bytes(data[: len(data) // 2])
    res = ds4("generate", "--model", str(path), "--prompt", "hi")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4-app: error:"), res.stderr
    assert "Traceback" not in res.stderr


def test_max_rows_is_an_engine_option_of_every_mode():
    from ds4_app.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([]).max_rows is None  # the backend's default (16 cpu, 512 cuda / hip)
    assert parser.parse_args(["--max-rows", "64", "--serve"]).max_rows == 64
    for cmd in (["generate", "--prompt", "hi"], ["bench"]):
        assert parser.parse_args([*cmd, "--max-rows", "32"]).max_rows == 32


@pytest.mark.parametrize("option,value", [("--max-rows", "0"), ("--max-rows", "-2"), ("--max-slots", "0")])
def test_an_engine_option_out_of_range_is_one_line(tiny_model_path, option, value):
    res = ds4("generate", "--model", tiny_model_path, option, value, "--prompt", "hi")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert lines == [f"ds4-app: error: {option} must be at least 1, got {value}"], res.stderr

