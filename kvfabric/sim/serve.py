"""``kvfabric sim-serve``: vLLM's real OpenAI-compatible server on a CPU, with a simulated model.

This process becomes ``vllm serve``: vLLM's API server, AsyncLLM, and an EngineCore process with vLLM's Scheduler,
KVCacheManager and BlockPool. Only the forward pass is modelled, by
:class:`~kvfabric.sim.executor.SimulatedExecutor` (``--distributed-executor-backend``), which fabricates outputs and
spends the time the H200 calibration of :mod:`kvfabric.sim.latency` gives for the model's shape. The KVFabric hook
is loaded as users load it: vLLM finds the ``vllm.general_plugins`` entry point and the plugin reads the
``KVFABRIC_*`` variables this command sets from its options. What vLLM needed for this: docs/design.md §8.

The model is a ``config.json`` only (``--load-format dummy``, ``--skip-tokenizer-init``): prompts are token ids on
``/v1/completions``. Exit status 2 with one line for bad options; otherwise vLLM's own.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvfabric.config import DEFAULT_HTTP_HOST

__all__ = ["DEFAULT_MODEL", "LATENCY_BY_MODEL", "build_vllm_argv", "configure", "run", "sim_env"]

DEFAULT_MODEL = "llama-3-8b"
#: Latency model (kvfabric/sim/latency.py) measured for each bundled shape; other shapes default to ``llama``.
LATENCY_BY_MODEL = {"llama-3-8b": "llama", "qwen2-0.5b": "qwen"}
EXECUTOR = "kvfabric.sim.executor.SimulatedExecutor"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  kvfabric sim-serve --kv-blocks 2048 --port 8000\n"
        "  kvfabric sim-serve --policy adaptive_aging --collector-socket /tmp/kvfabric.sock --run-id arm-b\n"
        "  kvfabric sim-serve --latency-scale 0 -- --max-num-seqs 32      # after --: more vllm serve options\n"
        "then: curl localhost:8000/v1/completions -d '{\"model\": \"llama-3-8b\", \"prompt\": [1001, 1002], "
        "\"max_tokens\": 4}'"
    )
    from kvfabric.policies import POLICY_NAMES

    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"model shape: a bundled name (llama-3-8b, qwen2-0.5b), a config.json file or a "
                             f"directory holding one (default {DEFAULT_MODEL})")
    parser.add_argument("--served-model-name", default=None, help="model name clients send (default: --model's name)")
    parser.add_argument("--kv-blocks", type=int, default=4096,
                        help="KV cache size in blocks (vLLM's --num-gpu-blocks-override; default 4096)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--max-model-len", type=int, default=8192,
                        help="longest prompt + output in tokens (default 8192; needs (kv-blocks - 1) x block-size "
                             ">= it)")
    parser.add_argument("--policy", choices=POLICY_NAMES, default=None,
                        help="KVFABRIC_EVICTION_POLICY (default: the environment's, else lru)")
    parser.add_argument("--collector-socket", default=None,
                        help="stream lifecycle events to this collector socket (sets KVFABRIC_LIFECYCLE=1 and "
                             "KVFABRIC_SINK=unix://PATH); without it the environment decides")
    parser.add_argument("--run-id", default=None, help="KVFABRIC_RUN_ID: the label on every event of this server")
    parser.add_argument("--host", default=DEFAULT_HTTP_HOST, help=f"HTTP host (default {DEFAULT_HTTP_HOST})")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--latency", default=None,
                        help="latency model: llama, qwen, qwen-fit, zero (default: the one measured for the shape)")
    parser.add_argument("--tokenizer", choices=("none", "words"), default="none",
                        help="none: token-id prompts only (--skip-tokenizer-init, as the GPU runs); words: a "
                             "word-level tokenizer of the benchmark's pseudo-words, for text prompts")
    parser.add_argument("--latency-scale", type=float, default=1.0,
                        help="multiply every modelled step time (default 1.0 = H200 time; 0 = infinitely fast)")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER,
                        help="after --: further `vllm serve` options, passed through unchanged")


def _model_name(model: str) -> str:
    path = Path(model)
    if path.is_dir():
        return path.name
    return path.stem if model.endswith(".json") else model


def build_vllm_argv(args: argparse.Namespace, model_dir: str) -> list[str]:
    """The ``vllm serve`` command line this server runs (``argv[0]`` is ``vllm``)."""
    extra = list(args.vllm_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    return [
        "vllm", "serve", model_dir,
        "--served-model-name", args.served_model_name or _model_name(args.model),
        "--distributed-executor-backend", EXECUTOR,
        "--load-format", "dummy",
        *(["--skip-tokenizer-init"] if getattr(args, "tokenizer", "none") == "none" else []),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--num-gpu-blocks-override", str(args.kv_blocks),
        "--block-size", str(args.block_size),
        "--max-model-len", str(args.max_model_len),
        "--host", args.host,
        "--port", str(args.port),
        *extra,
    ]


def sim_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment variables this server sets (the EngineCore inherits them)."""
    from kvfabric.sim.executor import LATENCY_ENV, LATENCY_SCALE_ENV

    env = {
        "HF_HUB_OFFLINE": "1",  # the model is a local config.json
        "VLLM_NO_USAGE_STATS": "1",
        LATENCY_ENV: args.latency or LATENCY_BY_MODEL.get(_model_name(args.model), "llama"),
        LATENCY_SCALE_ENV: repr(float(args.latency_scale)),
    }
    if args.policy is not None:
        env["KVFABRIC_EVICTION_POLICY"] = args.policy
    if args.collector_socket is not None:
        env["KVFABRIC_LIFECYCLE"] = "1"
        env["KVFABRIC_SINK"] = f"unix://{os.path.abspath(args.collector_socket)}"
    if args.run_id is not None:
        env["KVFABRIC_RUN_ID"] = args.run_id
    return env


def _with_word_tokenizer(model_dir: str) -> str:
    """A private copy of ``model_dir``'s config.json with the word tokenizer beside it (never writes to the user's
    directory); removed at exit."""
    import atexit
    import shutil
    import tempfile

    from kvfabric.sim.tokenizer import write_word_tokenizer

    tmp = tempfile.mkdtemp(prefix="kvfabric-sim-words-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    shutil.copy(Path(model_dir) / "config.json", Path(tmp) / "config.json")
    write_word_tokenizer(tmp)
    return tmp


def _check(args: argparse.Namespace) -> str | None:
    """One line saying what is wrong with the options, or None."""
    from kvfabric.sim.latency import LATENCY_MODELS

    if args.block_size < 1 or args.kv_blocks < 2:
        return "--block-size must be >= 1 and --kv-blocks >= 2"
    if (args.kv_blocks - 1) * args.block_size < args.max_model_len:  # vLLM's null block holds nothing
        return (f"--kv-blocks {args.kv_blocks} (one is vLLM's null block) x --block-size {args.block_size} = "
                f"{(args.kv_blocks - 1) * args.block_size} tokens cannot hold one request of --max-model-len "
                f"{args.max_model_len}")
    if args.latency is not None and args.latency not in LATENCY_MODELS:
        return f"--latency {args.latency!r} is not one of {', '.join(sorted(LATENCY_MODELS))}"
    if args.latency_scale < 0:
        return "--latency-scale must be >= 0"
    if not 0 <= args.port < 65536:
        return "--port must be in 0..65535"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem is not None:
        print(f"kvfabric sim-serve: {problem}", file=sys.stderr)
        return 2
    from kvfabric.sim.harness import resolve_model_dir

    try:
        model_dir = resolve_model_dir(args.model)
        if args.tokenizer == "words":
            model_dir = _with_word_tokenizer(model_dir)
    except (FileNotFoundError, OSError) as exc:
        print(f"kvfabric sim-serve: {exc}", file=sys.stderr)
        return 2
    os.environ.update(sim_env(args))
    # Fork: the EngineCore inherits the simulated platform and the wrapped Scheduler class, and starts twice as
    # fast as with spawn (docs/design.md §8).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    from kvfabric.sim import platform

    platform.install()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = build_vllm_argv(args, model_dir)
    try:
        vllm_main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
