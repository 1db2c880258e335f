"""Latency models for the simulated model executor: how long one scheduler step takes on a GPU.

The constants come from measurements of vLLM 0.26.0 on one H200 (``shared/gpu/latency/README.md`` and
``fits.json``): a Qwen2-0.5B shape and a Llama-3-8B shape, random weights, bf16. The fitted forms are

* prefill of one chunk of ``n`` new tokens over ``k`` tokens already in the KV cache:
  ``a + b*n + c*n*(k + n/2)`` (the ``c`` term is attention: each new token attends to ``k`` cached tokens plus,
  on average, half of the chunk);
* one decode step of ``B`` sequences holding ``C`` context tokens in total: ``d + e*B + f*C``.

A scheduler step can mix both. Following the check in the README that reproduced measured mixed runs within
-11%..+8% (and matched the step counts exactly), a step is charged the fixed cost once, not once per request:

* a step with any prefill chunk: ``a + b*Np + c*sum(n*(k + n/2)) + e*Bd + f*Cd``,
* a decode-only step: ``d + e*B + f*C``,

where ``Np`` is the step's prefill tokens and ``Bd``/``Cd`` its decoding sequences and their context.

The Qwen shape has a structural misfit the README documents: steps of at most 512 tokens run as CUDA graphs at a
nearly flat ~5.5 ms, larger ones hit a CPU floor of ~15.7 ms. ``qwen`` uses that two-floor refinement;
``qwen-fit`` is the plain least-squares fit. ``llama`` is the plain fit (the README's n>512-only refit differs by a
few percent). Every fitted model also charges ``ingest_s_per_token`` per prompt token of each newly admitted
request (block hashing, prefix lookup, input preparation: measured at about 0.4 µs/token, outside the GPU step).

All times are seconds. Models are pure functions of the step's work: same work, same time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvfabric.settings import LATENCY_MODEL_NAMES

__all__ = [
    "LATENCY_MODELS",
    "FittedLatencyModel",
    "LatencyModel",
    "StepWork",
    "ZeroLatencyModel",
    "get_latency_model",
]


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one scheduler step asked the model to compute.

    Invariants: every ``n`` in ``prefill_chunks`` is >= 1 and every ``k`` >= 0; every decode context >= 1.
    """

    #: (n, k) per request whose step is a prefill chunk: n new tokens on top of k tokens already in KV.
    prefill_chunks: Sequence[tuple[int, int]] = ()
    #: Context length (tokens attended, including the new one) of each request decoding one token.
    decode_contexts: Sequence[int] = ()
    #: Prompt tokens of the requests admitted for the first time in this step (CPU-side ingestion cost).
    admitted_prompt_tokens: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, _ in self.prefill_chunks)

    @property
    def num_tokens(self) -> int:
        """Tokens in the forward pass: prefill tokens plus one per decoding sequence."""
        return self.num_prefill_tokens + len(self.decode_contexts)


@runtime_checkable
class LatencyModel(Protocol):
    """Maps a step's work to the seconds the GPU (and the engine's CPU side) would take."""

    name: str

    def step_seconds(self, work: StepWork) -> float: ...


@dataclass(frozen=True, slots=True)
class ZeroLatencyModel:
    """Every step takes no time: an infinitely fast model, for pure scheduling studies and fast tests.

    With it the simulated clock only moves when the engine idles until the next arrival, so every batch of
    arrivals is served completely before the next one.
    """

    name: str = "zero"

    def step_seconds(self, work: StepWork) -> float:
        return 0.0


@dataclass(frozen=True, slots=True)
class TwoFloorPrefill:
    """Qwen-shape prefill refinement: CUDA-graph regime for small steps, CPU floor above it.

    ``t = graph_a + graph_b*Np`` when the step has at most ``graph_max_tokens`` tokens, else
    ``max(floor_s, a + b*Np + c*sum(n*(k + n/2)))``.
    """

    graph_max_tokens: int
    graph_a: float
    graph_b: float
    floor_s: float
    a: float
    b: float
    c: float


@dataclass(frozen=True, slots=True)
class FittedLatencyModel:
    """The fitted forms above with one shape's constants (see the module docstring)."""

    name: str
    a: float
    b: float
    c: float
    d: float
    e: float
    f: float
    ingest_s_per_token: float = 0.4e-6
    two_floor: TwoFloorPrefill | None = field(default=None)

    def prefill_part(self, work: StepWork) -> float:
        """Seconds of the step's prefill part (0 when it has no prefill chunk)."""
        if not work.prefill_chunks:
            return 0.0
        n_total = 0
        attention = 0.0
        for n, k in work.prefill_chunks:
            n_total += n
            attention += n * (k + n / 2.0)
        tf = self.two_floor
        if tf is None:
            return self.a + self.b * n_total + self.c * attention
        if work.num_tokens <= tf.graph_max_tokens:
            return tf.graph_a + tf.graph_b * n_total
        return max(tf.floor_s, tf.a + tf.b * n_total + tf.c * attention)

    def step_seconds(self, work: StepWork) -> float:
        batch = len(work.decode_contexts)
        context = sum(work.decode_contexts)
        ingest = self.ingest_s_per_token * work.admitted_prompt_tokens
        if work.prefill_chunks:
            # Mixed or prefill-only step: the prefill part carries the per-step fixed cost, decoding
            # sequences only add their marginal per-sequence and per-context-token terms.
            return self.prefill_part(work) + self.e * batch + self.f * context + ingest
        if batch:
            return self.d + self.e * batch + self.f * context + ingest
        return ingest

    def prefill_request_seconds(self, prompt_tokens: int, cached_tokens: int = 0, chunk: int = 16384) -> float:
        """Prefill time of one request alone, chunked like the measurement (each chunk a step)."""
        total = 0.0
        k = cached_tokens
        while k < prompt_tokens:
            n = min(chunk, prompt_tokens - k)
            total += self.prefill_part(StepWork(prefill_chunks=((n, k),)))
            k += n
        return total


# Constants from shared/gpu/latency/fits.json (full precision) and the README's refinement for Qwen.
_QWEN_FIT = dict(
    a=0.006063888512796155,
    b=1.7425052243071572e-06,
    c=1.6519606326167395e-10,
    d=0.0016053754391733822,
    e=1.205912136130787e-05,
    f=1.869562524369324e-09,
)
_LLAMA_FIT = dict(
    a=0.009587527254264868,
    b=1.889065128218117e-05,
    c=1.0536590389290397e-09,
    d=0.00487045248528181,
    e=1.4477919392682924e-05,
    f=3.0420907018044335e-08,
)
_QWEN_TWO_FLOOR = TwoFloorPrefill(
    graph_max_tokens=512,  # the largest CUDA-graph capture size of the measured engine
    graph_a=5.904e-3,
    graph_b=-1.011e-6,  # fitted slope; flat within noise, slightly negative over 1..512 tokens
    floor_s=15.71e-3,
    a=9.723e-3,
    b=0.8788e-6,
    c=198.2e-12,
)

LATENCY_MODELS: dict[str, LatencyModel] = {
    "zero": ZeroLatencyModel(),
    "qwen": FittedLatencyModel(name="qwen", two_floor=_QWEN_TWO_FLOOR, **_QWEN_FIT),
    "qwen-fit": FittedLatencyModel(name="qwen-fit", **_QWEN_FIT),
    "llama": FittedLatencyModel(name="llama", **_LLAMA_FIT),
}
if tuple(LATENCY_MODELS) != LATENCY_MODEL_NAMES:  # the settings table names the models (it cannot import this)
    raise RuntimeError(f"kvfabric.settings.LATENCY_MODEL_NAMES {LATENCY_MODEL_NAMES} does not list the latency "
                       f"models {tuple(LATENCY_MODELS)}: name a new model there too")


def get_latency_model(model: str | LatencyModel) -> LatencyModel:
    """Return a latency model by name (``zero``, ``qwen``, ``qwen-fit``, ``llama``) or pass one through."""
    if isinstance(model, str):
        try:
            return LATENCY_MODELS[model]
        except KeyError:
            raise ValueError(f"unknown latency model {model!r}; known: {sorted(LATENCY_MODELS)}") from None
    if not isinstance(model, LatencyModel):
        raise TypeError(f"not a latency model: {model!r}")
    return model
