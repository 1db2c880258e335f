#!/usr/bin/env python3
"""Generate KVFabric's Grafana dashboards (JSON) from code.

    python dashboards/build.py            # (re)write dashboards/json/*.json
    python dashboards/build.py --check    # exit 1 if the committed JSON differs from what the code generates

The dashboards are defined with grafana-foundation-sdk (Grafana 11.6) in ``dashboards/kvfabric_dashboards/``;
the JSON under ``dashboards/json/`` is generated, committed, and provisioned into Grafana by
``dashboards/provisioning/dashboards/kvfabric.yml``. Output is deterministic (sorted keys, fixed ids), so a
regeneration without code changes is byte-identical.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
JSON_DIR = HERE / "json"

if str(HERE) not in sys.path:  # the generator package lives next to this script, not in an installed package
    sys.path.insert(0, str(HERE))

from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402
from kvfabric_dashboards import DASHBOARDS  # noqa: E402


def render(name: str) -> str:
    """The JSON text of dashboard ``name`` (a key of ``DASHBOARDS``), exactly as written to disk."""
    return json.dumps(DASHBOARDS[name](), cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render_all() -> dict[str, str]:
    """File name -> JSON text, for every dashboard."""
    return {name: render(name) for name in DASHBOARDS}


def write(out_dir: Path = JSON_DIR) -> list[Path]:
    """Write every dashboard into ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in render_all().items():
        path = out_dir / name
        path.write_text(content, encoding="utf-8")
        written.append(path)
    return written


def check(out_dir: Path = JSON_DIR) -> list[str]:
    """Problems between the generator and ``out_dir``: missing, differing or stale (ungenerated) JSON files."""
    problems = []
    expected = render_all()
    for name, content in expected.items():
        path = out_dir / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.read_text(encoding="utf-8") != content:
            problems.append(f"{path}: differs from the generator output")
    for path in sorted(out_dir.glob("*.json")):
        if path.name not in expected:
            problems.append(f"{path}: not produced by the generator (stale?)")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Command line: write (default) or ``--check``; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on differences")
    parser.add_argument("--out", type=Path, default=JSON_DIR, help=f"output directory (default {JSON_DIR})")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("run: python dashboards/build.py", file=sys.stderr)
            return 1
        print(f"{len(DASHBOARDS)} dashboards up to date in {args.out}")
        return 0
    for path in write(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
