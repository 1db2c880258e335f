"""``kvfabric sim-serve``: vLLM's real OpenAI-compatible server on a CPU, with a simulated model.

This process becomes ``vllm serve``: vLLM's API server, AsyncLLM, and an EngineCore process with vLLM's Scheduler,
KVCacheManager and BlockPool. Only the forward pass is modelled, by
:class:`~kvfabric.sim.executor.SimulatedExecutor` (``--distributed-executor-backend``), which fabricates outputs and
spends the time the H200 calibration of :mod:`kvfabric.sim.latency` gives for the model's shape. The KVFabric hook
is loaded as users load it: vLLM finds the ``vllm.general_plugins`` entry point and the plugin reads the
``KVFABRIC_*`` variables this command sets from its options. What vLLM needed for this: docs/decisions.md,
"vLLM's server on a CPU".

The model is a ``config.json`` (``--load-format dummy``) with, by default, the built-in tokenizer and chat template of
:mod:`kvfabric.sim.tokenizer` beside it: token-id prompts, text prompts and ``/v1/chat/completions`` all work.
``--tokenizer none`` runs as the GPU measurements did (``--skip-tokenizer-init``): token-id prompts on
``/v1/completions`` only, and a chat or text request gets a 400 that says so (:class:`TokenIdsOnly`). ``/docs``
is vLLM's offline Swagger UI (``--enable-offline-docs``: assets vendored in vLLM). Exit status 2 with one line for
bad options (an address in use among them); otherwise vLLM's own.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvfabric.argtypes import int_range, nonneg_float, port, positive_int
from kvfabric.policies import POLICY_NAMES
from kvfabric.sim.harness import resolve_model_dir
from kvfabric.sim.latency import LATENCY_MODELS
from kvfabric.sim.tokenizer import write_word_tokenizer
from kvfabric.usage import UsageError

__all__ = ["DEFAULT_MODEL", "LATENCY_BY_MODEL", "TokenIdsOnly", "build_vllm_argv", "configure", "run", "sim_env"]

DEFAULT_MODEL = "llama-3-8b"
#: Latency model (kvfabric/sim/latency.py) measured for each bundled shape; other shapes default to ``llama``.
LATENCY_BY_MODEL = {"llama-3-8b": "llama", "qwen2-0.5b": "qwen"}
EXECUTOR = "kvfabric.sim.executor.SimulatedExecutor"

LOOPBACK = "127.0.0.1"  # the simulated server binds loopback unless told otherwise



def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "examples:\n"
        "  kvfabric sim-serve --kv-blocks 2048 --port 8000\n"
        "  kvfabric sim-serve --policy adaptive_aging --collector-socket /tmp/kvfabric.sock --run-id arm-b\n"
        "  kvfabric sim-serve --latency-scale 0 -- --max-num-seqs 32      # after --: more vllm serve options\n"
        "then:\n"
        "  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n"
        "    -d '{\"model\": \"llama-3-8b\", \"prompt\": [1001, 1002], \"max_tokens\": 4}'\n"
        "  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        "    -d '{\"model\": \"llama-3-8b\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], "
        "\"max_tokens\": 4}'\n"
        "  (the simulated model answers with pseudo-words: fixed for a given prompt, never EOS)"
    )

    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"model shape: a bundled name (llama-3-8b, qwen2-0.5b), a config.json file or a "
                             f"directory holding one (default {DEFAULT_MODEL})")
    parser.add_argument("--served-model-name", default=None, help="model name clients send (default: --model's name)")
    parser.add_argument("--kv-blocks", type=int_range(2), default=4096,
                        help="KV cache size in blocks (vLLM's --num-gpu-blocks-override; default 4096)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--max-model-len", type=positive_int, default=8192,
                        help="longest prompt + output in tokens (default 8192; needs (kv-blocks - 1) x block-size "
                             ">= it)")
    parser.add_argument("--policy", choices=POLICY_NAMES, default=None,
                        help="KVFABRIC_EVICTION_POLICY (default: the environment's, else lru)")
    parser.add_argument("--collector-socket", default=None,
                        help="stream lifecycle events to this collector socket (sets KVFABRIC_LIFECYCLE=1 and "
                             "KVFABRIC_SINK=unix://PATH); without it the environment decides")
    parser.add_argument("--run-id", default=None, help="KVFABRIC_RUN_ID: the label on every event of this server")
    parser.add_argument("--host", default=LOOPBACK, help=f"HTTP host (default {LOOPBACK})")
    parser.add_argument("--port", type=port, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--latency", default=None,
                        help="latency model: llama, qwen, qwen-fit, zero (default: the one measured for the shape)")
    parser.add_argument("--tokenizer", choices=("words", "none"), default="words",
                        help="words: the built-in tokenizer and chat template (token-id, text and chat prompts; "
                             "the benchmark's pseudo-words are one token each); none: token-id prompts on "
                             "/v1/completions only (--skip-tokenizer-init, as the GPU runs) (default: words)")
    parser.add_argument("--latency-scale", type=nonneg_float, default=1.0,
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
        *(["--skip-tokenizer-init"] if getattr(args, "tokenizer", "words") == "none" else []),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enable-offline-docs",  # /docs from vLLM's vendored Swagger UI files, not a CDN
        *(["--middleware", f"{__name__}.TokenIdsOnly"] if getattr(args, "tokenizer", "words") == "none" else []),
        "--num-gpu-blocks-override", str(args.kv_blocks),
        "--block-size", str(args.block_size),
        "--max-model-len", str(args.max_model_len),
        "--host", args.host,
        "--port", str(args.port),
        # vLLM's default (0) kills the EngineCore the moment the server stops, often before the engine has shut its
        # scheduler down: KVFabric's last line (what cache-aware scheduling held) would then be lost. An idle engine
        # still exits at once; one with requests in flight gets up to 5 s.
        "--shutdown-timeout", "5",
        *extra,
    ]


def sim_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment variables this server sets (the EngineCore inherits them)."""
    from kvfabric.sim.executor import LATENCY_ENV, LATENCY_SCALE_ENV  # (imports vLLM: not for --help)

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
    """A private copy of ``model_dir``'s config.json with the built-in tokenizer beside it (never writes to the
    user's directory); removed at exit."""

    # transformers: ~1.6 s to import, only when the server starts
    import transformers

    config = json.loads((Path(model_dir) / "config.json").read_text())
    # transformers warns about a "Mistral regex" for any local tokenizer whose config.json names no
    # transformers_version: this one was written here, with the installed version.
    config.setdefault("transformers_version", transformers.__version__)
    tmp = tempfile.mkdtemp(prefix="kvfabric-sim-words-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    (Path(tmp) / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    write_word_tokenizer(tmp, int(config.get("vocab_size") or 0))
    return tmp


class TokenIdsOnly:
    """ASGI middleware for ``--tokenizer none``: a chat request, or a text prompt on ``/v1/completions``, gets a 400
    that says what to send (vLLM would answer a chat request with a 500 and an empty message)."""

    MESSAGE = ("this sim-serve runs without a tokenizer (--tokenizer none): send token ids, e.g. "
               "{\"prompt\": [1001, 1002]} to /v1/completions, or restart it without --tokenizer none for text "
               "and chat prompts")

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope.get("type") == "http" and scope.get("method") == "POST" else ""
        if path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
            await self._refuse(send)
            return
        if path != "/v1/completions":
            await self.app(scope, receive, send)
            return
        body, messages = b"", []
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if message.get("type") != "http.request" or not message.get("more_body"):
                break
        if _has_text_prompt(body):
            await self._refuse(send)
            return

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any) -> None:
        body = json.dumps({"error": {"message": self.MESSAGE, "type": "BadRequestError", "param": "prompt",
                                     "code": 400}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _NoChatWarmupWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Chat template warmup failed"


def _has_text_prompt(body: bytes) -> bool:
    """Whether a /v1/completions body asks for a text prompt (a string or a list of strings); anything unreadable
    is left to vLLM."""

    try:
        prompt = json.loads(body).get("prompt")
    except (ValueError, AttributeError):
        return False
    return isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))


def _check(args: argparse.Namespace) -> str | None:
    """One line saying what is wrong with the options, or None."""
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


def check_address(host: str, port_number: int) -> None:
    """Raise :class:`UsageError` naming ``host:port`` if vLLM could not listen there (in use, or not an address of
    this machine). Bound as vLLM's server binds it (``SO_REUSEADDR``: a port in TIME-WAIT is free)."""
    if port_number == 0:
        return
    shown = f"[{host}]:{port_number}" if ":" in host else f"{host}:{port_number}"
    try:
        infos = socket.getaddrinfo(host or None, port_number, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host!r}: cannot resolve it ({exc.strerror})") from None
    family, type_, proto, _, addr = infos[0]
    with socket.socket(family, type_, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            raise UsageError(f"cannot listen on {shown}: {exc.strerror or exc} (pick another --port, or stop what "
                             f"listens there)") from None


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem is not None:
        raise UsageError(problem)
    check_address(args.host, args.port)

    try:
        model_dir = resolve_model_dir(args.model)
        if args.tokenizer == "words":
            model_dir = _with_word_tokenizer(model_dir)
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise UsageError(f"--model {args.model}: {exc}") from None
    os.environ.update(sim_env(args))
    if args.tokenizer == "none":
        # vLLM renders a chat once at start and logs the failure (no tokenizer) as a warning with a traceback: the
        # expected case here, and TokenIdsOnly answers chat requests with a 400 that says why.
        logging.getLogger("vllm.renderers.base").addFilter(_NoChatWarmupWarning())
    # Fork: the EngineCore inherits the simulated platform and the wrapped Scheduler class, and starts twice as
    # fast as with spawn (docs/decisions.md "vLLM's server on a CPU").
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    from kvfabric.sim import platform  # (imports vLLM and torch: only when the server starts)

    platform.install()
    # vLLM: only when the server starts, not for `kvfabric sim-serve --help`
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = build_vllm_argv(args, model_dir)
    try:
        vllm_main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
