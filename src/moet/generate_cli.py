"""`moet generate [CHECKPOINT] --prompt TEXT` (default checkpoint: the shipped moet-tiny): one-shot offline generation through `LLM`
(every EngineConfig field is a flag), printing the completion; --json adds token ids and
finish reason."""
from __future__ import annotations

import argparse
import json


def run(args: argparse.Namespace) -> int:
    from moet.config import from_cli_args
    from moet.llm import LLM

    cfg = from_cli_args(args)
    with LLM(**vars(cfg)) as llm:           # closes the expert store (hot set saved) when it was used
        return _generate(llm, args)


def _generate(llm, args: argparse.Namespace) -> int:
    from moet.sampling_params import SamplingParams

    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed,
                        ignore_eos=args.ignore_eos)
    prompts = args.prompt or ["Hello"]
    if args.chat:
        outs = [llm.chat([{"role": "user", "content": p}], sp, use_tqdm=False)[0] for p in prompts]
        for p, o in zip(prompts, outs):
            o.prompt = p  # print the user's words, not the rendered template
    else:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}))
        else:
            print(f"{out.prompt}\n{c.text}" if args.chat else f"{out.prompt}{c.text}")
    return 0


def add_subcommand(subparsers) -> None:
    from moet.config import add_cli_arguments

    p = subparsers.add_parser("generate", help="generate text offline from a checkpoint", description=__doc__)
    add_cli_arguments(p)
    p.add_argument("--prompt", action="append", help="prompt text (repeat for several)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=run)
