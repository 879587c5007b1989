"""Where a serving step's time goes: `ds4-app bench` in-process, the engine thread under cProfile.

    python3 ext/gpu/bench/service_profile.py OUT.txt -- BENCH ARGS...
    (e.g. -- --model /tmp/f.gguf --backend cuda --max-slots 8 --concurrency 8 --waves 1
     --max-tokens 64 --ignore-eos --no-progress --no-chart --out /tmp/svc)

Runs the bench command unchanged, with EngineService's loop thread profiled (cProfile counts the
native step as one call, so its line is the engine's share and the rest is the service's Python;
the profiler inflates the Python part somewhat). Writes the top functions by own time and by
cumulative time to OUT.txt; the bench's own reports go where its --out says.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ds4_app import cli  # noqa: E402
from ds4_app.engine import service  # noqa: E402


def main() -> int:
    out, rest = Path(sys.argv[1]), sys.argv[sys.argv.index("--") + 1:]
    prof = cProfile.Profile()
    run = service.EngineService._run

    def profiled(self) -> None:
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()

    service.EngineService._run = profiled
    rc = cli.main(["bench", *rest])
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
    out.write_text(text.getvalue())
    print(text.getvalue()[:4000])
    return rc


if __name__ == "__main__":
    sys.exit(main())
