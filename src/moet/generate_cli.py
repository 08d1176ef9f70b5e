"""`moet generate [MODEL] --prompt TEXT` (default model: the shipped moet-tiny): one-shot offline
generation through `LLM` (every EngineConfig field is a flag), printing the completion; --json
adds token ids and finish reason. Every argument (sampling ones included) is checked before the
model loads."""
from __future__ import annotations

import argparse
import json

# generate's own flags -> the SamplingParams field each sets (for error messages in flag words)
_SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "seed": "--sampling-seed"}


def sampling_params(args: argparse.Namespace):
    """The SamplingParams of the flags, or one ConfigError line naming the flag."""
    from moet.errors import ConfigError
    from moet.sampling_params import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed,
                              ignore_eos=args.ignore_eos)
    except ConfigError as exc:
        msg = str(exc)
        for name, flag in _SAMPLING_FLAGS.items():
            if msg.startswith(name + "="):
                msg = flag + msg[len(name):]
        raise ConfigError(msg) from None


def run(args: argparse.Namespace) -> int:
    from moet.checkpoint.resolve import resolve_checkpoint
    from moet.config import from_cli_args
    from moet.errors import ConfigError
    from moet.llm import LLM

    sp = sampling_params(args)
    if args.prompt is not None and not all(args.prompt):
        raise ConfigError("--prompt is empty: give some text")
    args.model = resolve_checkpoint(args.model)
    cfg = from_cli_args(args)
    with LLM(**vars(cfg)) as llm:           # closes the expert store (hot set saved) when it was used
        return _generate(llm, args, sp)


def _generate(llm, args: argparse.Namespace, sp=None) -> int:
    sp = sp if sp is not None else sampling_params(args)
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


def add_subcommand(subparsers) -> argparse.ArgumentParser:
    from moet.config import GROUP_MODEL, HelpFormatter, add_cli_arguments, add_help_all, argument_group

    p = subparsers.add_parser(
        "generate", help="generate text offline from a checkpoint", formatter_class=HelpFormatter,
        usage="moet generate [MODEL] --prompt TEXT [options]",
        description="Generate text offline from a checkpoint (default: the shipped moet-tiny) and print it.")
    argument_group(p, GROUP_MODEL)                  # the model group first, then what to generate
    g = argument_group(p, "generation")
    g.add_argument("--prompt", action="append", metavar="TEXT", help="prompt text; repeat for several "
                                                                      "(default: Hello)")
    g.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat "
                                                       "template")
    g.add_argument("--max-tokens", type=int, default=32, metavar="N", help="most tokens to generate (default: 32)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default: 0)")
    g.add_argument("--sampling-seed", type=int, default=None, metavar="N", help="seed of the sampler")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, with token ids")
    add_cli_arguments(p)
    add_help_all(p, "generate")
    p.set_defaults(func=run)
    return p
