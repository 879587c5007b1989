#!/usr/bin/env bash
# Pass 31 call 3 (thirtieth session): on call 2's machine while it was still held (call 2's bench of the
# variants ran out of its budget after the 95 s synth), the heads-a-block A/B in one process on the
# flash-l4 file call 2 left in /tmp. The module of d28074c, as call 2.
export PYTHONPATH=/tmp/site; ls -la /tmp/f.gguf && timeout 150 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/heads.json --prefill-rows 2048 --long-ctx 0 --steps 20 --variants attnheads=-1,attnheads=16 2>&1 | grep -E "^prefill|^decode|bit|ident|Error|error" | head -40
