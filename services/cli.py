"""The `sluice` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from services.engine_args import add_engine_args, engine_args_from


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline generation with the in-process engine")
    add_engine_args(p)
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="a prompt (repeat for a batch); default: two example prompts",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", action="store_true", help="print the full outputs as JSON")
    p.set_defaults(func=_run_generate)


def _run_generate(ns: argparse.Namespace) -> int:
    from engine.engine import Engine

    args = engine_args_from(ns)
    prompts = ns.prompt or ["The capital of France is", "def fibonacci(n):"]
    engine = Engine(**{f: getattr(args, f) for f in args.__dataclass_fields__})
    try:
        outs = engine.generate(
            prompt=prompts,
            sampling_params={"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature},
        )
    finally:
        engine.shutdown()
    if ns.json:
        print(json.dumps(outs, indent=2, ensure_ascii=False))
    else:
        for prompt, out in zip(prompts, outs):
            meta = out["meta_info"]
            print(
                f"--- {prompt!r} -> {meta['completion_tokens']} tokens, "
                f"finish {meta['finish_reason']}"
            )
            print(out["text"])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    # SUPPRESS: a service's own --log-level (and SLUICE_LOG_LEVEL) must not be overridden
    # by this flag's default.
    parser.add_argument("--log-level", default=argparse.SUPPRESS, help="default: warning")
    sub = parser.add_subparsers(dest="command", required=True)
    from services import tiny_lora, tiny_model

    tiny_model.add_parser(sub)
    tiny_lora.add_parser(sub)
    _add_generate(sub)
    from services import router

    router.add_parser(sub)
    from services import detokenizer, serve, tokenizer, worker

    tokenizer.add_parser(sub)
    worker.add_parser(sub)
    detokenizer.add_parser(sub)
    serve.add_parser(sub)
    # (dispatched in main before parsing: every flag it does not know goes to serve)
    sub.add_parser("run-batch", help="run an OpenAI batch file through a deployment started "
                   "for it (vLLM's run-batch); see `sluice run-batch -h`", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["run-batch"]:
        from services import run_batch

        return run_batch.main(args[1:])
    parser = build_parser()
    ns = parser.parse_args(argv)
    level = getattr(ns, "log_level", "warning")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        return int(ns.func(ns) or 0)
    except ValueError as e:
        print(f"sluice: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
