"""``ds4-app generate``: run prompts through the engine service and print the replies.

Several ``--prompt`` run concurrently through the one paged engine (each prompt is a request of
its own), exactly as the TUI and the server run them. With ``--json`` the output is a list with
one object per prompt: ``tokens`` (generated ids), ``text``, ``reasoning``, ``finish_reason``,
``usage`` and ``timings``.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from ..cli import add_engine_arguments

    p = sub.add_parser("generate", help="run prompts and print the replies",
                       description="Run prompts through the engine and print the replies.")
    add_engine_arguments(p)
    p.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                   help="a user message (repeat for several concurrent requests)")
    p.add_argument("--raw", action="store_true", help="send each prompt as raw text, not as a chat turn")
    p.add_argument("--system", metavar="TEXT", help="system prompt for chat turns")
    p.add_argument("--thinking", action="store_true", help="thinking mode (reasoning before the answer)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per prompt")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..cli import UserError
    from ..engine.api import Finished, GenerationRequest
    from ..engine.chat import Message
    from ..engine.sampling import SamplerConfig
    from ..engine.service import EngineService

    try:
        sampling = SamplerConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                 min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                                 ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise UserError(str(e)) from None
    requests = []
    for text in args.prompt:
        if args.raw:
            requests.append(GenerationRequest(prompt=text, sampling=sampling))
        else:
            msgs = ((Message("system", args.system),) if args.system else ()) + (Message("user", text),)
            requests.append(GenerationRequest(messages=msgs, sampling=sampling, thinking=args.thinking))

    with EngineService.from_args(args, max_queue=max(64, len(requests))) as engine:
        handles = [engine.submit(r) for r in requests]
        results = []
        for h in handles:
            parts = {"content": [], "reasoning": []}
            final = None
            for ev in h.events():
                if isinstance(ev, Finished):
                    final = ev
                else:
                    parts[ev.kind].append(ev.text)
                    if not args.json and len(handles) == 1 and ev.kind == "content":
                        print(ev.text, end="", flush=True)
            results.append((parts, final))

    if args.json:
        out = []
        for (parts, fin) in results:
            u = fin.usage
            out.append({
                "tokens": list(fin.tokens), "text": "".join(parts["content"]),
                "reasoning": "".join(parts["reasoning"]), "finish_reason": fin.finish_reason,
                "error": fin.error,
                "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                          "cached_tokens": u.cached_tokens},
                "timings": {"queue_s": u.queue_s, "ttft_s": u.ttft_s, "prefill_s": u.prefill_s,
                            "decode_s": u.decode_s, "total_s": u.total_s,
                            "decode_tok_s": u.decode_tok_s, "prefill_tok_s": u.prefill_tok_s},
            })
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        for i, (parts, fin) in enumerate(results):
            if len(results) > 1:
                print(f"--- prompt {i + 1} ({fin.finish_reason}) ---")
                print("".join(parts["content"]))
            else:
                print()
            if fin.error:
                print(f"ds4-app: request failed: {fin.error}", file=sys.stderr)
    return 1 if any(fin.finish_reason == "error" for _, fin in results) else 0
