"""The `colibri` command line: one small function per subcommand, registered in a table.

User mistakes (bad paths, unsupported or corrupt checkpoints) print one line
`colibri: error: ...` and exit with status 2, never a traceback. Every command that takes a
model checks it with engine.format.modelcheck.check_model before loading anything; every one
defaults to the bundled demo model and to one precision (engine.format.convert.DEFAULT_QUANT).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colibri.engine import __version__
from colibri.engine.core.options import (
    GENERATION_OPTIONS,
    OPTION,
    add_option_args,
    check_flag,
    option_values,
)
from colibri.engine.format.modelcheck import ModelError, check_model
from colibri.engine.tools.cache_args import (
    add_device_args,
    add_expert_cache_args,
    device_from_args,
    expert_cache_from_args,
    threads_from_args,
)

if TYPE_CHECKING:
    from colibri.engine.sample.sampler import SamplingParams


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None]):  # noqa: ANN201
    """Register the decorated function as subcommand `name`."""

    def wrap(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = Command(name, help, configure, run)
        return run

    return wrap


def _convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face model folder (safetensors)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output Colibri model folder (new)")
    add_option_args(p, ("quant",))
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--add-mtp", action="store_true",
                   help="OUT_DIR is an existing conversion of HF_DIR made without the "
                        "checkpoint's multi-token-prediction layer: convert only that layer "
                        "into it (for --speculative mtp)")


@command("convert", "convert a Hugging Face checkpoint into a Colibri folder", _convert_args)
def _convert(args: argparse.Namespace) -> int:
    from colibri.engine.format.convert import convert

    check_model(args.hf_dir, flag="HF_DIR")
    if args.add_mtp:
        return _add_mtp(args.hf_dir, args.out_dir)
    out = convert(args.hf_dir, args.out_dir, quant=args.quant, progress=not args.no_progress)
    print(f"wrote {out}")
    return 0


def _add_mtp(hf_dir: str, folder: str) -> int:
    from colibri.engine.format.convert import MTP_DIR, add_mtp, is_colibri_dir

    if not is_colibri_dir(folder):
        raise ValueError(f"{folder}: not a Colibri model folder (--add-mtp adds to one)")
    if add_mtp(hf_dir, folder):
        print(f"added the multi-token-prediction layer to {folder}/{MTP_DIR}")
        return 0
    if (Path(folder) / MTP_DIR / "config.json").is_file():
        print(f"{folder} has its multi-token-prediction layer already")
        return 0
    print(f"{hf_dir} ships no multi-token-prediction layer that Colibri runs: nothing added",
          file=sys.stderr)
    return 1


def _model_args(p: argparse.ArgumentParser) -> None:
    """--model and --quant, the same on every command that loads a model."""
    add_option_args(p, ("model", "quant"))


def _info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", metavar="DIR", nargs="?", default=None,
                   help="model folder, the same as --model")
    _model_args(p)
    add_device_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")


@command("info", "describe a model: architecture, parameters, bytes by type", _info_args)
def _info(args: argparse.Namespace) -> int:
    from colibri.engine.format.convert import ensure_converted
    from colibri.engine.tools.info import describe, render

    if args.model_dir is not None and args.model is not None:
        raise ValueError("give the model folder once: DIR or --model")
    given = args.model_dir if args.model_dir is not None else args.model
    source = check_model(given, flag="--model" if args.model_dir is None else "DIR")
    folder = ensure_converted(source, args.quant, progress=True)
    d = describe(folder, **device_from_args(args))  # type: ignore[arg-type]
    print(json.dumps(d, indent=2) if args.json else render(d))
    return 0


def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", metavar="DIR", help="converted Colibri model folder")
    p.add_argument("--quick", action="store_true", help="check sizes only, not sha256")


@command("verify", "check a converted model's files against config.json", _verify_args)
def _verify(args: argparse.Namespace) -> int:
    from colibri.engine.format.convert import verify

    check_model(args.model_dir, flag="DIR")
    verify(args.model_dir, full=not args.quick, deep=True)
    print(f"{args.model_dir}: ok")
    return 0


def _generate_args(p: argparse.ArgumentParser) -> None:
    _model_args(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message with the model's chat template")
    add_option_args(p, GENERATION_OPTIONS)  # max_tokens, temperature, top_p, top_k, seed
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_option_args(p, ("threads",))
    add_device_args(p)
    add_expert_cache_args(p)
    add_option_args(p, ("speculative", "num_speculative_tokens"))


def _generate_params(args: argparse.Namespace) -> SamplingParams:
    """generate's sampling options as SamplingParams, checked before anything loads, each by
    the one check the server applies to the same field, and named by its option."""
    from colibri.engine.sample.sampler import SamplingParamError, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
    try:
        # none of these options is a token id, so the vocabulary's size (known once the
        # model is loaded) plays no part in the check
        params.validate(vocab_size=1)
    except SamplingParamError as e:
        flag = "--" + e.param.replace("_", "-") + (" " if e.message.startswith("must") else ": ")
        raise ValueError(f"{flag}{e.message}, got {getattr(params, e.param)!r}") from None
    threads_from_args(args)
    device_from_args(args)
    check_flag(OPTION["num_speculative_tokens"], args.num_speculative_tokens)
    return params


@command("generate", "write a completion of a prompt to stdout as it is generated",
         _generate_args)
def _generate(args: argparse.Namespace) -> int:
    from colibri.engine.core.loader import EngineConfig
    from colibri.engine.llm import LLM

    params = _generate_params(args)
    check_model(args.model)
    config = EngineConfig(expert_cache=expert_cache_from_args(args),
                          **device_from_args(args),  # type: ignore[arg-type]
                          speculative=args.speculative,
                          num_speculative_tokens=args.num_speculative_tokens)
    llm = LLM(args.model, threads=threads_from_args(args), quant=args.quant,
              config=config)
    if args.chat:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        ids = llm.tokenizer.encode(args.prompt, add_special_tokens=True)
        sys.stdout.write(args.prompt)
    for out in llm.generate_tokens(ids, params):
        sys.stdout.write(out.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    llm.core.close()
    return 0


def _plan_args(p: argparse.ArgumentParser) -> None:
    _model_args(p)
    add_option_args(p, ("gpu_memory_mb",))
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="plan for the machine this device profile describes (a JSON file, or "
                        "h200, kept with Colibri) instead of measuring this one")
    p.add_argument("--json", action="store_true", help="print JSON")


@command("plan", "where a model's work would run beside a GPU, and the predicted step times",
         _plan_args)
def _plan(args: argparse.Namespace) -> int:
    from colibri.engine.format.convert import ensure_converted
    from colibri.engine.tools.plan import plan_main

    budget = option_values(args, ("gpu_memory_mb",))["gpu_memory_mb"]
    source = check_model(args.model)
    print(plan_main(ensure_converted(source, args.quant, progress=True), args.profile,
                    budget, args.json))  # type: ignore[arg-type]
    return 0


def _eval_args(p: argparse.ArgumentParser) -> None:
    from colibri.engine.tools.evaluate import configure_eval_parser

    configure_eval_parser(p)


@command("eval", "perplexity of a model over a text (quantization quality check)", _eval_args)
def _eval(args: argparse.Namespace) -> int:
    from colibri.engine.tools.evaluate import eval_main

    return eval_main(args)


def _bench_args(p: argparse.ArgumentParser) -> None:
    from colibri.engine.tools.bench import add_bench_args

    add_bench_args(p)


@command("bench", "measure prefill and decode tokens/s against the memory-bandwidth bound",
         _bench_args)
def _bench(args: argparse.Namespace) -> int:
    from colibri.engine.tools.bench import bench_main

    return bench_main(args)


def _replay_args(p: argparse.ArgumentParser) -> None:
    from colibri.engine.tools.replay import add_replay_args

    add_replay_args(p)


@command("replay", "hit rates of expert cache policies (and the optimum) on a routing trace",
         _replay_args)
def _replay(args: argparse.Namespace) -> int:
    from colibri.engine.tools.replay import replay_main

    return replay_main(args)


AddParser = Callable[[Any], argparse.ArgumentParser]


def build_parser(extra: Sequence[AddParser] = ()) -> argparse.ArgumentParser:
    """The parser of every engine subcommand, plus those `extra` registers (e.g. serve)."""
    parser = argparse.ArgumentParser(
        prog="colibri",
        description="Colibri: serve and run Mixture-of-Experts language models on a CPU. "
                    "Without --model, commands use the bundled demo model.")
    parser.add_argument("--version", action="version", version=f"colibri {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for c in COMMANDS.values():
        c.configure(sub.add_parser(c.name, help=c.help, description=c.help))
    for add in extra:
        add(sub)  # sets its own `handler` default
    return parser


def main(argv: list[str] | None = None, extra: Sequence[AddParser] = ()) -> int:
    """Entry point of the `colibri` script; returns the exit status.

    Layers above the engine (the HTTP server) add their subcommands through `extra`, so the
    engine never imports them.
    """
    parser = build_parser(extra)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed its message
        return int(e.code or 0)
    run = getattr(args, "handler", None) or COMMANDS[args.command].run
    try:
        return int(run(args))
    except ModelError as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("colibri: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
