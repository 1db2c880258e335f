"""Every ``KVFABRIC_*`` environment variable, declared once: :data:`SETTINGS`.

Each :class:`Setting` names the variable, its type, its documented default, the values it accepts, the component
that reads it and what it does. :func:`read` is the one parser, used by the hook (:func:`kvfabric.engine.config.
load_hook_settings`), the collector and the simulated executor. The settings tables of README.md,
README.zh-CN.md and docs/design.md are rendered from :data:`SETTINGS` between ``<!-- settings:begin -->`` and
``<!-- settings:end -->``::

    python -m kvfabric.settings               # print the table
    python -m kvfabric.settings --write-docs  # rewrite the tables in place
    python -m kvfabric.settings --check       # exit 1 if a table differs (tests/test_settings.py does the same)

Rules: an unset or empty (blank) variable means its default. A bad value gives one warning line naming the
variable, the value, what is accepted and what is used instead, and what is used instead is always the documented
default: a typo never turns a feature on. Booleans accept 1/0/true/false/yes/no/on/off in any case. Limits the
collector enforces (label lengths, batch rows: :mod:`kvfabric.contract.protocol`) are checked here, so a value the
collector would refuse never leaves the hook.

Importing this module imports nothing outside the standard library and :mod:`kvfabric.contract.protocol`: vLLM imports
it in every process that loads plugins, with KVFabric on or off.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfabric.argtypes import number_text
from kvfabric.contract import protocol as P

log = logging.getLogger("kvfabric.settings")

HOOK = "vLLM plugin"
COLLECTOR = "collector"
SIM = "sim-serve"
READERS = (HOOK, COLLECTOR, SIM)
"""Which component reads a variable: the plugin inside vLLM, the collector process, the simulated model executor
of ``kvfabric sim-serve``."""

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
BOOL_ACCEPTED = "1/0/true/false/yes/no/on/off"

BEGIN = "<!-- settings:begin -->"
END = "<!-- settings:end -->"
DOC_FILES = ("README.md", "README.zh-CN.md", "docs/design.md")
"""Files holding the generated table, relative to the repository root."""


class BadValue(ValueError):
    """A value a setting does not accept; the message says what is wrong with it ("is not an integer")."""


@dataclass(frozen=True)
class Setting:
    """One variable. ``kind`` is ``bool``, ``int``, ``float``, ``choice``, ``label``, ``path``, ``sink`` or
    ``secret``; ``default`` is the value used when the variable is unset, empty or bad (the documented one)."""

    name: str
    kind: str
    default: Any
    help: str
    reader: str = HOOK
    field: str | None = None  # the HookSettings attribute it fills (hook settings)
    minimum: float | None = None
    maximum: float | None = None
    choices: Callable[[], tuple[str, ...]] | None = None  # called when needed: keeps this module's imports light
    max_chars: int | None = None
    default_note: str = ""  # plain words after the default in warnings and docs ("off")
    default_doc: str | None = None  # Markdown for the docs' default column, when the value alone says too little

    def accepted(self) -> str:
        """What the variable accepts, in words (warnings and the docs' column)."""
        if self.kind == "bool":
            return BOOL_ACCEPTED
        if self.kind in ("int", "float"):
            what = "an integer" if self.kind == "int" else "a number"
            if self.minimum is not None and self.maximum is not None:
                return f"{what} from {number_text(self.minimum)} to {number_text(self.maximum)}"
            if self.minimum is not None:
                return f"{what} >= {number_text(self.minimum)}"
            return what
        if self.kind == "choice":
            assert self.choices is not None
            return "/".join(self.choices())
        if self.kind == "label":
            return f"text of at most {self.max_chars} characters"
        if self.kind == "path":
            return "a file path"
        if self.kind == "sink":
            return "unix://PATH, jsonl://PATH or none"
        return "any text"

    def default_text(self) -> str:
        """The default as warnings say it: ``0 (off)``, ``'lru'``, ``(the model shipped in the package)``."""
        value = said(self.default)
        if self.default_note:
            return f"{value} ({self.default_note})" if value else f"({self.default_note})"
        return value

    def parse(self, raw: str) -> Any:
        """The value of a set, non-blank variable; :class:`BadValue` if it is not accepted."""
        text = raw if self.kind == "secret" else raw.strip()
        if self.kind == "bool":
            word = text.lower()
            if word in TRUE_WORDS:
                return True
            if word in FALSE_WORDS:
                return False
            raise BadValue("is not a boolean")
        if self.kind == "int":
            try:
                number: float = int(text)
            except ValueError:
                raise BadValue("is not an integer") from None
            return self._in_range(number)
        if self.kind == "float":
            try:
                number = float(text)
            except ValueError:
                raise BadValue("is not a number") from None
            if not math.isfinite(number):
                raise BadValue("is not a finite number")
            return self._in_range(number)
        if self.kind == "choice":
            assert self.choices is not None
            word = text.lower()
            if word not in self.choices():
                raise BadValue("is not one of the accepted values")
            return word
        _check_utf8(text)
        if self.kind == "label":
            assert self.max_chars is not None
            if len(text) > self.max_chars:
                raise BadValue("is too long")
            return text
        if self.kind == "path":
            return os.path.abspath(text)
        if self.kind == "sink":
            return _sink(text)
        return text

    def _in_range(self, number: float) -> float:
        if self.minimum is not None and number < self.minimum:
            raise BadValue(f"is below {number_text(self.minimum)}")
        if self.maximum is not None and number > self.maximum:
            raise BadValue(f"is above {number_text(self.maximum)}")
        return number


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return number_text(value)
    return str(value)


def said(value: Any) -> str:
    """A value as a warning says it: text quoted (empty or None: nothing), numbers and booleans (1/0) bare."""
    if value is None:
        return ""
    if isinstance(value, str):
        return repr(value) if value else ""
    return _plain(value)


def _check_utf8(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 reach os.environ as lone surrogates
        raise BadValue("is not valid UTF-8") from None


def _sink(text: str) -> str:
    if text.lower() == "none":
        return "none"
    for scheme in ("unix://", "jsonl://"):
        if text.startswith(scheme):
            if not text[len(scheme):]:
                raise BadValue("names no path")
            return text
    raise BadValue("is not a sink")


def _policy_names() -> tuple[str, ...]:
    # (Read when the table is rendered or a value checked, not at import: vLLM imports this module in every
    # process that loads plugins, and it stays free of the rest of KVFabric.)
    from kvfabric.policies import POLICY_NAMES

    return POLICY_NAMES


#: The simulated GPU's latency models by name (``KVFABRIC_SIM_LATENCY``, ``--latency``). Named here, beneath the
#: simulator, so the table checks a value without importing it; :mod:`kvfabric.sim.latency` defines one model per
#: name, in this order, and refuses to load otherwise.
LATENCY_MODEL_NAMES: tuple[str, ...] = ("zero", "qwen", "qwen-fit", "llama")


def _latency_models() -> tuple[str, ...]:
    return LATENCY_MODEL_NAMES


SETTINGS: tuple[Setting, ...] = (
    # ---- the vLLM plugin (kvfabric.engine.config.load_hook_settings) ----
    Setting("KVFABRIC_LIFECYCLE", "bool", False, "record lifecycle events", field="lifecycle",
            default_doc="`0` (`1` when `KVFABRIC_LIFECYCLE_LOG_PATH` is set)"),
    Setting("KVFABRIC_SINK", "sink", "", "where events go: a collector's socket (`unix://`), a JSONL file "
            "(`jsonl://`), or nowhere (`none`: made and dropped)", field="sink",
            default_doc="`jsonl://` + `KVFABRIC_LIFECYCLE_LOG_PATH` when that is set, else `unix://` + the private "
                        "default socket (`$XDG_RUNTIME_DIR/kvfabric/kvfabric.sock`, else "
                        "`/tmp/kvfabric-<uid>/kvfabric.sock`)"),
    Setting("KVFABRIC_LIFECYCLE_LOG_PATH", "path", "", "shorthand for "
            "`KVFABRIC_LIFECYCLE=1 KVFABRIC_SINK=jsonl://PATH`: record into this JSONL file (an explicit "
            "`KVFABRIC_LIFECYCLE=0` keeps recording off; an explicit "
            "`KVFABRIC_SINK` takes precedence)", default_note="unset"),
    Setting("KVFABRIC_EVICTION_POLICY", "choice", "lru", "`lru` is vLLM's own order, untouched; the others are "
            "KVFabric's policies, and other engines' as baselines (`lfu`, `slru`, `fifo`: SGLang's; `tlru`: "
            "tail-optimized LRU) (`docs/design.md` §6)", field="policy", choices=_policy_names),
    Setting("KVFABRIC_POLICY_MODEL", "path", "", "the `learned` policy's reuse model (a `kvfabric learn --out` file), "
            "loaded once at start: an unreadable or invalid file gives a warning and the built-in model",
            field="policy_model", default_note="the built-in model", default_doc="the model shipped in the package"),
    Setting("KVFABRIC_PROTECT_MIN_HIT_COUNT", "int", 1, "hits before a block counts as protected",
            field="protect_min_hit_count", minimum=1),
    Setting("KVFABRIC_TLRU_THRESHOLD_TOKENS", "int", 2048, "the `tlru` policy's TTFT budget xi: prefill tokens a "
            "returning turn may recompute; the tail of a conversation past its first L + Q_hat - xi tokens is "
            "evicted first (arXiv:2510.15152; `docs/design.md` §6)", field="tlru_threshold_tokens", minimum=0),
    Setting("KVFABRIC_TLRU_NEXT_PROMPT_TOKENS", "int", 256, "the `tlru` policy's Q_hat: new prompt tokens expected "
            "in a conversation's next turn", field="tlru_next_prompt_tokens", minimum=0),
    Setting("KVFABRIC_ADMISSION_ANCHOR_BLOCKS", "int", 0, "admission gate: cache at most this many leading blocks of "
            "requests outside a known family. Off by default: on the synthetic trace it lowers the hit rate (the "
            "cost by capacity is in `docs/policy-results.md`)",
            field="admission_anchor_blocks", minimum=0, default_note="off"),
    Setting("KVFABRIC_CACHE_AWARE_SCHEDULING", "bool", False, "hold a waiting request while a running one prefills "
            "the blocks it needs; each time the scheduler drains and when vLLM shuts it down, its log says how many "
            "requests were held so far (written only when the count moved; the last line is the total)",
            field="cache_aware_scheduling"),
    Setting("KVFABRIC_NATIVE", "bool", True, "`0`: record and steer with the Python code (pool hooks, victim index, "
            "free path) even where its compiled copy is built; both make the same records and decisions",
            field="native"),
    Setting("KVFABRIC_FAMILY_DEPTH", "int", None, "a fixed depth F: a request's family is its block at depth "
            "min(F, len - 1) instead of the one below its chain's widest branch point (`docs/design.md` §5)",
            field="family_depth", minimum=0, default_note="the widest branch point",
            default_doc="unset (the widest branch point)"),
    Setting("KVFABRIC_FAMILY_FROM_REQUEST_ID", "bool", False, "also take a family from a `<family>/<rest>` request "
            "id (opt-in: request ids are not KVFabric's)", field="family_from_request_id"),
    Setting("KVFABRIC_RUN_ID", "label", "default", "label of this run (A/B arm, experiment), carried on every event",
            field="run_id", max_chars=P.MAX_LABEL_CHARS),
    Setting("KVFABRIC_ENGINE_ID", "label", "", "engine label, stable across restarts so metric labels stay bounded",
            field="engine_id", max_chars=P.MAX_LABEL_CHARS, default_note="<host>/dp<rank>",
            default_doc="`<host>/dp<rank>`"),
    Setting("KVFABRIC_HOST", "label", "", "host name carried on every event (`host` column) and in the stream's "
            "metadata, and the `<host>` of the default engine label", field="host", max_chars=P.MAX_LABEL_CHARS,
            default_note="the machine's host name", default_doc="the machine's host name (`socket.gethostname()`)"),
    Setting("KVFABRIC_BATCH_EVENTS", "int", 4096, "a batch goes out every N events ...", field="batch_events",
            minimum=1, maximum=P.MAX_BATCH_ROWS - 1),  # (a batch may carry one more row: the report of lost events)
    Setting("KVFABRIC_FLUSH_MS", "int", 100, "... or every T ms, whichever comes first", field="flush_ms",
            minimum=1),
    Setting("KVFABRIC_BUFFER_EVENTS", "int", 1_000_000, "bound on events held in memory before they are dropped and "
            "counted (the ring holds 48 bytes per event, at least 1 KiB)", field="buffer_events", minimum=1),
    Setting("KVFABRIC_EVICTED_MEMORY", "int", 0, "recently evicted digests the forwarder remembers for "
            "rebuilt/regret detection (one digest, its time and family each)", field="evicted_memory", minimum=0,
            default_note="64 x the pool's blocks, at least 65536, at most 1000000"),
    Setting("KVFABRIC_REGRET_WINDOW_S", "float", 60.0, "W of the regretful-eviction definition, in seconds "
            "(`docs/design.md` §5)", field="regret_window_s", minimum=0),
    # ---- the collector ----
    Setting("KVFABRIC_API_TOKEN", "secret", "", "bearer token for `/api/v1` and `/metrics` (`--token` takes "
            "precedence); never logged", reader=COLLECTOR,
            default_note="no token: no auth; a collector bound beyond loopback then refuses to start unless "
                         "--allow-remote-without-token",
            default_doc="unset: no auth (a collector bound beyond loopback then refuses to start unless "
                        "`--allow-remote-without-token`)"),
    Setting("KVFABRIC_MAX_LABEL_RUNS", "int", 64, "distinct run labels in `/metrics` before `_other` "
            "(`--max-label-runs` takes precedence)", reader=COLLECTOR, minimum=1),
    # ---- kvfabric sim-serve's simulated model executor (set from its options) ----
    Setting("KVFABRIC_SIM_LATENCY", "choice", "llama", "latency model of the simulated GPU (`--latency`)",
            reader=SIM, choices=_latency_models),
    Setting("KVFABRIC_SIM_LATENCY_SCALE", "float", 1.0, "multiplies the simulated latency; 0 makes the model "
            "infinitely fast (`--latency-scale`)", reader=SIM, minimum=0),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}

_UNSET: Any = object()


def shown(raw: str, setting: Setting | None = None) -> str:
    """``raw`` as a warning quotes it: one line, long values cut, secrets never."""
    if setting is not None and setting.kind == "secret":
        return f"<{len(raw)} characters>"
    if len(raw) > 200:
        return f"{raw[:60]!r}... ({len(raw)} characters)"
    return repr(raw)


def read(name: str, env: Mapping[str, str] | None = None, warnings: list[str] | None = None, *,
         default: Any = _UNSET, default_text: str | None = None) -> Any:
    """The value of ``name`` in ``env`` (default: ``os.environ``), parsed by its :class:`Setting`.

    Unset or blank: the default. Bad: the default, and one warning line appended to ``warnings`` (logged when
    ``warnings`` is None). ``default``/``default_text`` replace the table's default where another setting decides it
    (``KVFABRIC_LIFECYCLE_LOG_PATH`` for ``KVFABRIC_LIFECYCLE`` and ``KVFABRIC_SINK``): the documented rule, not a
    second default."""
    setting = BY_NAME[name]
    env = os.environ if env is None else env
    if default is _UNSET:
        default = setting.default
        default_text = setting.default_text()
    elif default_text is None:
        default_text = said(default)
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return setting.parse(raw)
    except BadValue as exc:
        message = (f"{name}={shown(raw, setting)} {exc} (accepted: {setting.accepted()}); "
                   f"using the default {default_text}")
        if warnings is None:
            log.warning("kvfabric: %s", message)
        else:
            warnings.append(message)
        return default


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` holds a non-blank value (good or bad)."""
    raw = (os.environ if env is None else env).get(name)
    return raw is not None and bool(raw.strip())


# ------------------------------------------------------------------------------------------------ documentation

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default_cell(s: Setting) -> str:
    if s.default_doc is not None:
        return s.default_doc
    value = _plain(s.default)
    if not value:
        return s.default_note
    cell = f"`{value}`"
    return f"{cell} ({s.default_note})" if s.default_note else cell


def _accepted_cell(s: Setting) -> str:
    if s.kind in ("bool", "choice"):
        return " ".join(f"`{word}`" for word in s.accepted().split("/"))
    if s.kind == "sink":
        return "`unix://PATH`, `jsonl://PATH`, `none`"
    return s.accepted()


def render_table() -> str:
    """The Markdown settings table (the text between the docs' markers)."""
    lines = [
        "<!-- generated from kvfabric/settings.py by `python -m kvfabric.settings --write-docs`; edit it there -->",
        "",
        "| variable | read by | accepted | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        cells = (f"`{s.name}`", s.reader, _accepted_cell(s), _default_cell(s), s.help)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def replace_table(text: str, table: str | None = None) -> str:
    """``text`` with the part between its markers replaced by the table; ValueError without exactly one pair."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"needs exactly one {BEGIN} ... {END} pair")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{render_table() if table is None else table}\n{END}{tail}"


def table_in(text: str) -> str:
    """The part of ``text`` between its markers (what :func:`replace_table` writes there)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"needs exactly one {BEGIN} ... {END} pair")
    return text.split(BEGIN)[1].split(END)[0].strip("\n")


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(render_table())
        return 0
    if args not in (["--write-docs"], ["--check"]):
        print("usage: python -m kvfabric.settings [--write-docs | --check]", file=sys.stderr)
        return 2
    table = render_table()
    stale = []
    for rel in DOC_FILES:
        path = os.path.join(repo_root(), rel)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if table_in(text) == table:
            continue
        stale.append(rel)
        if args == ["--write-docs"]:
            with open(path, "w", encoding="utf-8") as f:
                f.write(replace_table(text, table))
    verb = "rewrote" if args == ["--write-docs"] else "out of date:"
    if stale:
        print(f"{verb} {', '.join(stale)}")
    return 1 if stale and args == ["--check"] else 0


if __name__ == "__main__":
    sys.exit(main())
