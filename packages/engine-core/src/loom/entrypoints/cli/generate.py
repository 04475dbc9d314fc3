"""``loom generate``: answer a prompt with a model, in this process."""

from __future__ import annotations

import argparse
import sys

from loom_plugin_api import SamplingParams

from ...engine.arg_utils import EngineArgs
from ..chat_utils import load_chat_template


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("generate", help="generate text with a model, offline")
    parser.add_argument("prompt", nargs="+", help="prompt text (several words are joined)")
    parser.add_argument("--model", default=None, help="model path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--chat-template", default=None,
                        help="chat template instead of the tokenizer's: the path of a Jinja file, or the template itself")
    EngineArgs.add_cli_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from ..llm import LLM  # lazy: it loads torch, which `loom generate --help` does not need

    chat_template = load_chat_template(args.chat_template)  # a bad template fails before the model loads
    engine_args = EngineArgs.from_cli_args(args)
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
    llm = LLM(args.model, **kwargs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    prompt = " ".join(args.prompt)
    has_template = chat_template is not None or getattr(llm.get_tokenizer(), "chat_template", None) is not None
    if has_template and not args.raw:
        out = llm.chat([{"role": "user", "content": prompt}], params, chat_template=chat_template)[0]
    else:
        out = llm.generate(prompt, params)[0]
    sys.stdout.write(out.outputs[0].text.strip() + "\n")
    return 0
