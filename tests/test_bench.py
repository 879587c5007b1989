"""ds4-app bench: metrics on hand-made timelines, fixtures, waves, A/B/A, reports, CLI runs.

The harness tests that need no model use ``ScriptedEngine``, an EngineClient whose outputs are a
pure function of (prompt, sampling) and which records how many requests were in flight at once.
The end-to-end tests run the real engine on the tiny synthetic preset (skipped, with the reason,
while the native runner has not landed) and the real server for URL mode.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ds4_app.bench.arms import ArmSpec, bracket, run_arms
from ds4_app.bench.compare import compare_arms, compare_level, metric_change, pct_change
from ds4_app.bench.fixtures import MIXED, REPLICATED
from ds4_app.bench.fixtures.build_mixed import build_mixed, build_replicated, render
from ds4_app.bench.metrics import RequestRecord, level_metrics, percentile, set_sha256, sha256_text
from ds4_app.bench.progress import Progress
from ds4_app.bench.prompts import PromptError, load_prompts, read_jsonl
from ds4_app.bench.report import CHART_SKIPPED, chart_available, write_reports
from ds4_app.bench.runner import BenchPlan, LevelRun, run_levels, run_wave
from ds4_app.cli import UserError, build_parser, main
from ds4_app.commands.bench import apply_overrides, command_line, parse_levels
from ds4_app.engine.api import Finished, StatsSnapshot, Usage
from ds4_app.engine.chat import Delta
from ds4_app.engine.sampling import SamplerConfig

ROOT = Path(__file__).resolve().parent.parent


# --- a scripted engine ----------------------------------------------------------------------


class _Handle:
    def __init__(self, request_id, events):
        self.request_id = request_id
        self._events = events

    def events(self, timeout=None):
        yield from self._events()

    def __aiter__(self):  # not used by the bench; present to satisfy the protocol
        raise NotImplementedError


class ScriptedEngine:
    """Outputs depend only on the prompt text, and on the seed when temperature > 0; each token
    takes ``token_s`` of wall time and the first waits ``prefill_s``. Records peak concurrency."""

    model_name = "scripted"

    def __init__(self, token_s=0.002, prefill_s=0.01, eos_after=None):
        self.token_s, self.prefill_s, self.eos_after = token_s, prefill_s, eos_after
        self.in_flight = 0
        self.peak = 0
        self.submitted = 0
        self._lock = threading.Lock()

    def _words(self, req):
        text = req.prompt if req.prompt is not None else "\n".join(m.content for m in req.messages)
        s = req.sampling
        key = text if s.temperature == 0 else f"{text}|{s.seed}|{s.temperature}"
        h = hashlib.sha256(key.encode()).hexdigest()
        return text, [f"w{h[(i * 2) % 60:(i * 2) % 60 + 4]} " for i in range(64)]

    def submit(self, req):
        text, words = self._words(req)
        with self._lock:
            self.submitted += 1
        n = req.sampling.max_tokens or 16
        if self.eos_after is not None and not req.sampling.ignore_eos:
            n = min(n, self.eos_after)
        n_prompt = len(text.split())

        def events():
            with self._lock:
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
            t0 = time.monotonic()
            try:
                time.sleep(self.prefill_s)
                t_first = time.monotonic()
                for i in range(n):
                    if i:
                        time.sleep(self.token_s)
                    kind = "reasoning" if req.thinking and i < 2 else "content"
                    yield Delta(kind, words[i % len(words)])
            finally:
                with self._lock:
                    self.in_flight -= 1
            now = time.monotonic()
            yield Finished("length", Usage(prompt_tokens=n_prompt, completion_tokens=n, ttft_s=t_first - t0,
                                           prefill_s=t_first - t0, decode_s=now - t_first, total_s=now - t0))

        return _Handle(req.request_id, events)

    def cancel(self, request_id):
        pass

    def stats(self):
        return StatsSnapshot.empty(backend="scripted", device="test", model="scripted")

    def count_prompt_tokens(self, messages, prompt, thinking=False):
        return 0

    def close(self):
        pass


def plan(levels=(1, 2), waves=2, max_tokens=6, **sampling):
    sampling.setdefault("ignore_eos", True)
    return BenchPlan(concurrency=levels, waves=waves, warmup=0,
                     sampling=SamplerConfig(max_tokens=max_tokens, **sampling))


def rec(wave, lane, t_start, t_first, t_end, completion, prompt=10, content="x", **kw):
    return RequestRecord(wave=wave, lane=lane, prompt_id=f"p{lane}", prompt_sha256=sha256_text(f"p{lane}"),
                         t_start=t_start, t_first=t_first, t_end=t_end, prompt_tokens=prompt,
                         completion_tokens=completion, finish_reason=kw.pop("finish_reason", "length"),
                         content=content, **kw)


# --- metrics on hand-made timelines ---------------------------------------------------------


def test_percentile_interpolates_between_order_statistics():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 100) == 5.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_level_metrics_exact_numbers():
    # Wave 0: start 0, firsts 1.0 and 2.0, ends 5.0 and 4.0; wave 1: start 10, firsts 10.5/11.5, ends 12/14.
    records = [
        rec(0, 0, 0.0, 1.0, 5.0, 9, prompt=100, native_prefill_s=0.5),
        rec(0, 1, 0.0, 2.0, 4.0, 5, prompt=300, native_prefill_s=1.5),
        rec(1, 1, 10.0, 11.5, 14.0, 11, prompt=40, native_prefill_s=0.2, cached_tokens=20),
        rec(1, 0, 10.0, 10.5, 12.0, 4, prompt=60),
    ]
    m = level_metrics(2, records, max_tokens=None, ignore_eos=False)
    assert (m.requests, m.waves, m.completion_tokens, m.prompt_tokens, m.cached_tokens) == (4, 2, 29, 500, 20)
    # walls 5 and 4; windows (5-1)=4 and (14-10.5)=3.5; prefill windows 2 and 1.5
    assert m.wall_s == 9.0
    assert m.aggregate_tok_s == pytest.approx(29 / 9)
    assert m.output_window_s == 7.5
    assert m.output_window_tok_s == pytest.approx(29 / 7.5)
    assert m.prompt_tok_s_to_first == pytest.approx(500 / 3.5)
    assert [w.aggregate_tok_s for w in m.per_wave] == [pytest.approx(14 / 5), pytest.approx(15 / 4)]
    assert m.aggregate_tok_s_median_wave == pytest.approx((14 / 5 + 15 / 4) / 2)
    assert m.output_window_tok_s_median_wave == pytest.approx((14 / 4 + 15 / 3.5) / 2)
    # TTFTs 1.0, 2.0, 1.5, 0.5
    assert m.ttft_p50_s == pytest.approx(1.25)
    assert m.ttft_p95_s == pytest.approx(1.5 + 0.85 * 0.5)
    assert m.ttft_max_s == 2.0
    # decode: 8/4=2, 4/2=2, 10/2.5=4, 3/1.5=2 -> median 2
    assert m.request_decode_tok_s == pytest.approx(2.0)
    # native prefill: 100/0.5=200, 300/1.5=200, (40-20)/0.2=100 -> median 200
    assert m.native_prefill_tok_s == pytest.approx(200.0)
    assert m.valid and m.finish_reasons == {"length": 4}
    order = sorted(records, key=lambda r: (r.wave, r.lane))
    assert m.output_set_sha256 == set_sha256(r.output_sha256 for r in order)
    assert m.prompt_set_sha256 == set_sha256(r.prompt_sha256 for r in order)


def test_rates_without_a_time_base_are_none_and_order_does_not_matter():
    one = [rec(0, 0, 0.0, None, 1.0, 0, content="")]
    m = level_metrics(1, one, max_tokens=4, ignore_eos=False)
    assert m.output_window_tok_s is None and m.ttft_p50_s is None and m.request_decode_tok_s is None
    assert m.prompt_tok_s_to_first is None and m.aggregate_tok_s == 0.0
    a = [rec(0, 0, 0.0, 0.5, 2.0, 3, content="a"), rec(0, 1, 0.0, 0.7, 2.5, 3, content="b")]
    assert level_metrics(2, a, max_tokens=3, ignore_eos=True) == level_metrics(2, a[::-1], max_tokens=3,
                                                                                ignore_eos=True)


def test_validity_with_ignore_eos_and_errors():
    full = [rec(0, i, 0.0, 0.1, 1.0, 8) for i in range(2)]
    assert level_metrics(2, full, max_tokens=8, ignore_eos=True).valid
    short = full[:1] + [rec(0, 1, 0.0, 0.1, 1.0, 7, finish_reason="stop")]
    m = level_metrics(2, short, max_tokens=8, ignore_eos=True)
    assert not m.valid and "not exactly 8 tokens" in m.invalid_reasons[0]
    assert level_metrics(2, short, max_tokens=8, ignore_eos=False).valid  # EOS is allowed without ignore_eos
    err = full[:1] + [rec(0, 1, 0.0, None, 1.0, 0, finish_reason="error", error="boom")]
    m = level_metrics(2, err, max_tokens=8, ignore_eos=False)
    assert not m.valid and m.errors == 1 and "boom" in m.invalid_reasons[0]


def test_output_hashes_cover_content_and_reasoning():
    a = rec(0, 0, 0, 1, 2, 3, content="hello", reasoning="")
    b = rec(0, 0, 0, 1, 2, 3, content="hello", reasoning="think")
    c = rec(0, 0, 0, 1, 2, 3, content="hello", reasoning="")
    assert a.content_sha256 == hashlib.sha256(b"hello").hexdigest()
    assert a.output_sha256 != b.output_sha256 and a.output_sha256 == c.output_sha256
    assert b.reasoning_sha256 == hashlib.sha256(b"think").hexdigest()


# --- A/B/A arithmetic -----------------------------------------------------------------------


def test_bracket_change_and_drift():
    def level(c, ow, content="x"):
        return LevelRun(c, (), level_metrics(c, [rec(0, 0, 0.0, 1.0, 1.0 + 10.0 / ow, 10, content=content)],
                                             max_tokens=None, ignore_eos=False))

    a1, b, a2 = level(2, 100.0), level(2, 110.0), level(2, 102.0)
    m = metric_change("output_window_tok_s", "higher", a1.metrics, b.metrics, a2.metrics)
    assert m.baseline_mean == pytest.approx(101.0)
    assert m.change_pct == pytest.approx((110 / 101 - 1) * 100)
    assert m.drift_pct == pytest.approx(2.0)
    assert m.clears_2x_drift is True
    m2 = metric_change("output_window_tok_s", "higher", a1.metrics, level(2, 103.0).metrics, a2.metrics)
    assert m2.clears_2x_drift is False
    assert pct_change(1.0, 0.0) is None and pct_change(None, 1.0) is None


def test_bracket_counts_mismatching_outputs():
    def run(contents):
        rs = [rec(0, i, 0.0, 0.1, 1.0, 4, content=t) for i, t in enumerate(contents)]
        return LevelRun(len(rs), tuple(rs), level_metrics(len(rs), rs, max_tokens=4, ignore_eos=True))

    same = compare_level(run("abc"), run("abc"), run("abc"))
    assert (same.mismatches, same.baseline_mismatches, same.exact) == (0, 0, True)
    diff = compare_level(run("abc"), run("xbz"), run("abc"))
    assert (diff.mismatches, diff.baseline_mismatches, diff.exact) == (2, 0, False)
    assert len(diff.mismatch_examples) == 2
    drift = compare_level(run("abc"), run("abc"), run("abd"))
    assert (drift.mismatches, drift.baseline_mismatches, drift.exact) == (1, 1, False)


# --- prompts --------------------------------------------------------------------------------


def test_shipped_fixtures_are_what_the_generator_makes():
    assert MIXED.read_text(encoding="utf-8") == render(build_mixed())
    assert REPLICATED.read_text(encoding="utf-8") == render(build_replicated())


def test_mixed_fixture_is_36_distinct_prompts_from_short_to_about_2k_tokens():
    ps = load_prompts("mixed")
    assert len(ps.prompts) == 36 and not ps.replicated
    texts = [p.messages[-1].content for p in ps.prompts]
    assert len(set(texts)) == 36 and len({p.id for p in ps.prompts}) == 36
    # No two prompts share their first 40 characters (no reusable prefix for a prefix cache).
    assert len({t[:40] for t in texts}) == 36
    words = [len(t.split()) for t in texts]
    assert min(words) < 20 and 1300 < max(words) < 1700  # ~1.3 tokens a word: about 2k tokens
    # Every wave of four mixes tiers.
    for w in range(9):
        assert len({p.id.split("-")[0] for p in ps.prompts[4 * w:4 * w + 4]}) >= 2


def test_wave_selection_replicated_and_distinct(tmp_path):
    rep = load_prompts("replicated")
    waves = rep.waves(3, 2)
    assert [len(w) for w in waves] == [3, 3] and len({p.sha256 for w in waves for p in w}) == 1
    mixed = load_prompts("mixed")
    waves = mixed.waves(4, 2)
    ids = [p.id for w in waves for p in w]
    assert ids == [p.id for p in mixed.prompts[:8]]
    with pytest.raises(PromptError, match="needs 40 distinct prompts"):
        mixed.waves(4, 10)
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "a"}\n\n{"prompt": "raw text", "id": "r"}\n'
                 '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}\n')
    ps = load_prompts(str(f))
    assert [p.raw for p in ps.prompts] == [None, "raw text", None]
    assert ps.prompts[1].id == "r" and [m.role for m in ps.prompts[2].messages] == ["system", "user"]
    assert ps.prompts[1].request(SamplerConfig()).prompt == "raw text"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b", "prompt": "c"}\n')
    with pytest.raises(PromptError, match="bad.jsonl:2"):
        read_jsonl(bad)


# --- the harness on a scripted engine -------------------------------------------------------


def test_wave_starts_together_and_holds_concurrency():
    eng = ScriptedEngine(token_s=0.005)
    ps = load_prompts("mixed")
    records = run_wave(eng, ps.prompts[:4], plan(max_tokens=5), wave=0)
    assert eng.peak == 4 and len(records) == 4
    starts = [r.t_start for r in records]
    assert max(starts) - min(starts) < 0.05
    assert [r.lane for r in records] == [0, 1, 2, 3]
    assert all(r.completion_tokens == 5 and r.t_first is not None for r in records)


def test_run_levels_measures_each_level_with_its_own_prompts():
    eng = ScriptedEngine()
    ps = load_prompts("mixed")
    p = plan(levels=(1, 3), waves=2, max_tokens=4)
    runs = run_levels(eng, ps, p)
    assert [r.concurrency for r in runs] == [1, 3]
    assert eng.submitted == 1 * 2 + 3 * 2
    lv3 = runs[1]
    assert sorted(r.prompt_id for r in lv3.records) == sorted(q.id for q in ps.prompts[:6])
    assert lv3.metrics.valid and lv3.metrics.completion_tokens == 24
    # Same prompts, same outputs: the level hash repeats; with the seed changed at temperature > 0 it does not.
    again = run_levels(eng, ps, p)
    assert again[1].metrics.output_set_sha256 == lv3.metrics.output_set_sha256
    other = run_levels(eng, ps, plan(levels=(1, 3), waves=2, max_tokens=4, temperature=0.8, seed=5))
    assert other[1].metrics.output_set_sha256 != lv3.metrics.output_set_sha256


def test_short_completions_with_ignore_eos_are_caught():
    eng = ScriptedEngine(eos_after=3)
    runs = run_levels(eng, load_prompts("replicated"), plan(levels=(2,), waves=1, max_tokens=5, ignore_eos=False))
    assert runs[0].metrics.valid  # natural EOS is fine without --ignore-eos
    # A server that ignores ignore_eos (scripted here by stopping at 3 whatever the flag says).
    eng.submit = _forcing_eos(eng.submit)
    runs = run_levels(eng, load_prompts("replicated"), plan(levels=(2,), waves=1, max_tokens=5))
    assert not runs[0].metrics.valid


def _forcing_eos(submit):
    def wrapped(req):
        import dataclasses

        return submit(dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, ignore_eos=False)))
    return wrapped


def test_progress_draws_on_a_terminal_only():
    class Tty(list):
        def write(self, s):
            self.append(s)

        def flush(self):
            pass

        def isatty(self):
            return True

    out = Tty()
    p = Progress(4, stream=out)
    p.set_label("A C=2 wave 1/2")
    p.advance(2, 10)
    p.note("level done")
    p.advance(2, 5)
    p.close()
    text = "".join(out)
    assert "\r" in text and "4/4 req" in text and "15 tok" in text and "level done\n" in text
    out2 = Tty()
    out2.isatty = lambda: False
    q = Progress(2, stream=out2)
    q.advance(1)
    q.note("only this")
    q.close()
    assert "".join(out2) == "only this\n"


def _scripted_arm_results(b_sampling):
    import ds4_app.bench.arms as arms_mod
    from ds4_app.bench.target import OpenTarget, TargetSpec

    eng = ScriptedEngine()

    class FakeTargets:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def get(self, spec):
            return OpenTarget(spec, eng, ["scripted"])

    base = ArmSpec("A", "run", TargetSpec(model="x"), plan(levels=(1, 2), waves=2, max_tokens=4))
    cand_plan = plan(levels=(1, 2), waves=2, max_tokens=4, **b_sampling)
    arms = bracket(base, TargetSpec(model="x"), cand_plan, tuple((k, str(v)) for k, v in b_sampling.items()))
    orig = arms_mod.Targets
    arms_mod.Targets = FakeTargets
    try:
        return run_arms(arms, load_prompts("mixed"))
    finally:
        arms_mod.Targets = orig


def test_abba_on_scripted_engine_and_reports(tmp_path):
    same = _scripted_arm_results({})
    cmp_same = compare_arms(same[0].levels, same[1].levels, same[2].levels)
    assert [c.concurrency for c in cmp_same] == [1, 2]
    assert all(c.exact and c.mismatches == 0 for c in cmp_same)
    diff = _scripted_arm_results({"temperature": 0.7, "seed": 3})
    cmp_diff = compare_arms(diff[0].levels, diff[1].levels, diff[2].levels)
    assert [c.mismatches for c in cmp_diff] == [2, 4] and not any(c.exact for c in cmp_diff)

    files = write_reports(tmp_path / "r", diff, cmp_diff, prompt_set=load_prompts("mixed"), label="t",
                          command=["ds4-app", "bench"])
    data = json.loads(files.json.read_text())
    assert [a["name"] for a in data["arms"]] == ["A1", "B", "A2"]
    assert data["arms"][1]["overrides"] == {"temperature": "0.7", "seed": "3"}
    assert data["comparison"]["mismatches"] == 6 and data["comparison"]["exact"] is False
    md = files.markdown.read_text()
    assert "## A/B/A bracket" in md and "| 2 |" in md and "no (0/4)" in md
    lines = files.outputs.read_text().splitlines()
    assert len(lines) == 3 * (2 + 4)
    if chart_available():
        assert files.chart is not None and files.chart.read_bytes()[:4] == b"\x89PNG"
    else:
        assert files.chart is None and data["chart_skipped"] == CHART_SKIPPED and CHART_SKIPPED in md


# --- command-line pieces --------------------------------------------------------------------


def _bench_args(*argv):
    parser = build_parser()
    args = parser.parse_args(["bench", *argv])
    return args.bench_parser, args


def test_parse_levels():
    assert parse_levels("1,2,4") == (1, 2, 4)
    assert parse_levels("1-3,6") == (1, 2, 3, 6)
    assert parse_levels("2,2,1") == (2, 1)
    for bad in ("0", "a", "3-1", "1,,2"):
        with pytest.raises(ValueError):
            parse_levels(bad)


def test_compare_set_overrides_convert_like_the_options():
    parser, args = _bench_args("--model", "m.gguf", "--seed", "0")
    cand, applied = apply_overrides(parser, args, ["seed=1", "temperature=0.5", "backend=reference",
                                                   "ignore-eos=true", "qat-numerics=false", "max_slots=2"])
    assert (cand.seed, cand.temperature, cand.backend, cand.ignore_eos, cand.qat_numerics, cand.max_slots) == \
        (1, 0.5, "reference", True, False, 2)
    assert args.seed == 0 and args.backend == "cpu"  # the baseline is untouched
    assert applied[0] == ("seed", "1")
    cand, _ = apply_overrides(parser, args, ["model=none", "url=http://127.0.0.1:9"])
    assert cand.model is None and cand.url == "http://127.0.0.1:9"
    for bad, msg in (("backend=vulkan", "not one of"), ("seed=x", "not a valid value"), ("out=/tmp", "cannot be set"),
                     ("nonsense=1", "cannot be set"), ("seed", "KEY=VALUE"), ("ignore-eos=maybe", "true or false")):
        with pytest.raises(ValueError, match=msg):
            apply_overrides(parser, args, [bad])


def test_compare_set_max_rows_reaches_the_candidate_target():
    from ds4_app.commands.bench import target_spec

    parser, args = _bench_args("--model", "m.gguf")
    cand, applied = apply_overrides(parser, args, ["max-rows=32"])
    assert applied == (("max-rows", "32"),)
    base, spec = target_spec(args, 1), target_spec(cand, 1)
    assert base.max_rows is None and spec.max_rows == 32 and base.key != spec.key
    assert base.describe()["max_rows"] is None and spec.describe()["max_rows"] == 32
    assert apply_overrides(parser, cand, ["max-rows=none"])[0].max_rows is None
    _, url_args = _bench_args("--url", "http://h:1")
    assert "max_rows" not in target_spec(url_args, 1).describe()
    with pytest.raises(ValueError, match="not a valid value"):
        apply_overrides(parser, args, ["max-rows=many"])


def test_command_line_is_reconstructed_without_the_api_key():
    parser, args = _bench_args("--url", "http://h:1", "--api-key", "secret", "--concurrency", "1,4",
                               "--ignore-eos", "--compare-set", "seed=2", "--no-progress")
    cmd = command_line(parser, args)
    assert cmd[:2] == ["ds4-app", "bench"] and "secret" not in cmd
    assert cmd[2:] == ["--url", "http://h:1", "--concurrency", "1,4", "--ignore-eos", "--compare-set", "seed=2",
                       "--no-progress"]


def test_bad_options_are_one_line_user_errors(capsys):
    assert main(["bench", "--concurrency", "0", "--no-progress"]) == 2
    assert "ds4-app: error:" in capsys.readouterr().err
    assert main(["bench", "--model", "synth:huge", "--no-progress"]) == 2
    assert "unknown synthetic preset" in capsys.readouterr().err
    assert main(["bench", "--prompts", "mixed", "--concurrency", "4", "--waves", "10", "--no-progress"]) == 2
    assert "needs 40 distinct prompts" in capsys.readouterr().err
    assert main(["bench", "--model", "a.gguf", "--url", "http://x", "--no-progress"]) == 2
    assert "exclusive" in capsys.readouterr().err
    with pytest.raises(UserError):
        from ds4_app.commands.bench import run

        _, args = _bench_args("--compare-set", "bogus=1")
        run(args)
    assert main(["bench", "--max-rows", "0", "--no-progress"]) == 2
    assert "--max-rows must be at least 1, got 0" in capsys.readouterr().err
    assert main(["bench", "--compare-set", "max-rows=-1", "--no-progress"]) == 2
    assert "--compare-set: --max-rows must be at least 1, got -1" in capsys.readouterr().err


# --- end to end on the real engine ----------------------------------------------------------

needs_engine = pytest.mark.skipif(importlib.util.find_spec("ds4_app.engine.runner") is None,
                                  reason="the native runner (ds4_app.engine.runner) has not landed yet")

TINY = ["--model", "synth:tiny", "--backend", "cpu", "--max-ctx", "512", "--max-tokens", "8", "--ignore-eos",
        "--warmup", "0", "--no-progress"]


@needs_engine
def test_cpu_tiny_bench_writes_every_report(tmp_path, capsys):
    out = tmp_path / "run"
    # Runs in a few seconds on 2 cores (no timed assertion here: design.md §11).
    rc = main(["bench", *TINY, "--concurrency", "1,2,4", "--waves", "2", "--out", str(out), "--label", "tiny"])
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "bench.json").read_text())
    assert data["valid"] and data["command"][:4] == ["ds4-app", "bench", "--model", "synth:tiny"]
    assert "commit" in data["git"] and data["machine"]["cores_logical"]
    arm = data["arms"][0]
    assert arm["engine"]["backend"] == "cpu" and arm["engine"]["model"]
    assert any("temporary file" in n for n in data["notes"])
    levels = arm["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2, 4]
    keys = {"aggregate_tok_s", "output_window_tok_s", "ttft_p50_s", "ttft_p95_s", "ttft_max_s",
            "request_decode_tok_s", "prompt_tok_s_to_first", "native_prefill_tok_s", "requests",
            "prompt_tokens", "completion_tokens", "valid", "output_set_sha256", "prompt_set_sha256", "per_wave"}
    for lv in levels:
        m = lv["metrics"]
        assert keys <= m.keys()
        assert m["requests"] == lv["concurrency"] * 2 and m["completion_tokens"] == 8 * m["requests"]
        assert m["valid"] and m["output_window_tok_s"] > 0 and m["ttft_p95_s"] > 0
        assert all(len(r["output_sha256"]) == 64 and r["content_sha256"] for r in lv["requests"])
    # Replicated prompt, greedy, batch-invariant engine: every lane at every level gives the same output.
    assert len({r["output_sha256"] for lv in levels for r in lv["requests"]}) == 1
    md = (out / "bench.md").read_text()
    assert "| 4 | 8 | yes |" in md
    if chart_available():
        assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert not (out / "bench.png").exists() and data["chart_skipped"] == CHART_SKIPPED


@needs_engine
@pytest.mark.parametrize("overrides,exact", [([], True), (["--compare-set", "seed=1", "--compare-set",
                                                           "temperature=0.9"], False)])
def test_cpu_tiny_abba(tmp_path, overrides, exact):
    out = tmp_path / "abba"
    rc = main(["bench", *TINY, "--temperature", "0.9", "--concurrency", "1,2", "--waves", "1", "--compare",
               *overrides, "--out", str(out), "--require-exact"])
    data = json.loads((out / "bench.json").read_text())
    cmp_ = data["comparison"]
    assert [lv["baseline_mismatches"] for lv in cmp_["levels"]] == [0, 0]
    if exact:
        assert rc == 0 and cmp_["exact"] and cmp_["mismatches"] == 0
    else:
        assert rc == 1 and not cmp_["exact"] and cmp_["mismatches"] > 0


@needs_engine
def test_cpu_tiny_abba_over_max_rows_is_exact_and_reports_the_rows(tmp_path):
    out = tmp_path / "rows"
    rc = main(["bench", *TINY, "--concurrency", "1,2", "--waves", "1", "--compare-set", "max-rows=32",
               "--out", str(out), "--require-exact"])
    data = json.loads((out / "bench.json").read_text())
    assert rc == 0 and data["comparison"]["exact"]
    limits = [a["engine"]["step_limits"] for a in data["arms"]]
    assert [x["max_rows"] for x in limits] == [16, 32, 16]
    assert [x["lone_prompt_rows"] for x in limits] == [16, 32, 16]
    assert [a["target"]["max_rows"] for a in data["arms"]] == [None, 32, None]
    assert "32 rows a step" in (out / "bench.md").read_text()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_engine
def test_url_mode_matches_in_process_hashes(tmp_path):
    for mod in ("ds4_app.server.main", "ds4_app.engine.remote", "ds4_app.commands.serve"):
        try:
            if importlib.util.find_spec(mod) is None:
                pytest.skip(f"{mod} is not importable yet")
        except ImportError as e:
            pytest.skip(f"{mod} is not importable yet ({e})")
    from ds4_app.engine.synth import synthesize

    model = tmp_path / "tiny.gguf"
    synthesize("tiny", str(model), seed=0)
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "ds4_app", "--serve", "--model", str(model), "--max-ctx", "2048",
                             "--host", "127.0.0.1", "--port", str(port)], env=env, cwd=str(ROOT),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server did not start: {proc.stderr.read().decode()[-2000:] if proc.poll() is not None else 'timeout'}")
            time.sleep(0.2)
        common = ["--max-tokens", "8", "--ignore-eos", "--warmup", "0", "--no-progress", "--concurrency", "1,2",
                  "--waves", "1", "--prompts", "mixed"]
        assert main(["bench", "--url", f"http://127.0.0.1:{port}", *common, "--out", str(tmp_path / "url")]) == 0
        assert main(["bench", "--model", str(model), "--max-ctx", "2048", *common, "--out", str(tmp_path / "in")]) == 0
    finally:
        proc.terminate()
        proc.wait(30)
    url = json.loads((tmp_path / "url" / "bench.json").read_text())
    inp = json.loads((tmp_path / "in" / "bench.json").read_text())
    for a, b in zip(url["arms"][0]["levels"], inp["arms"][0]["levels"]):
        assert a["metrics"]["prompt_set_sha256"] == b["metrics"]["prompt_set_sha256"]
        assert a["metrics"]["output_set_sha256"] == b["metrics"]["output_set_sha256"]
