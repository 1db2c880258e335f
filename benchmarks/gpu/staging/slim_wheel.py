"""Here (no GPU time): copy a wheel without members that the GPU runs never load, so it travels in fewer commands.

The default drops vLLM 0.26.0's FlashAttention-2 kernels (``vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so``: 124 of the
wheel's 289 MiB). On Hopper cards (H100, H200) vLLM runs FlashAttention 3 (its log says "Using FlashAttention
version 3", as the committed GPU runs' logs do), and it imports the FA2 library inside a ``try``: without it
``FA2_AVAILABLE`` is false and nothing else changes. The copy keeps the wheel's file name; its ``RECORD`` loses the
dropped lines, so pip installs it as it would the original.

Usage: ``python3 slim_wheel.py WHEEL OUT_DIR [--drop MEMBER ...]``; then give ``OUT_DIR/<same name>`` to stage.sh.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

DEFAULT_DROP = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",)


def slim(wheel: Path, out_dir: Path, drop: tuple[str, ...]) -> Path:
    """Write ``out_dir/<wheel's name>``: every member but ``drop``, ``RECORD`` without their lines.

    Raises ``SystemExit`` when a member named in ``drop`` is not in the wheel (a wrong name would drop nothing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    if target.resolve() == wheel.resolve():
        raise SystemExit("slim_wheel: OUT_DIR must differ from the wheel's folder")
    with zipfile.ZipFile(wheel) as src:
        names = set(src.namelist())
        missing = [m for m in drop if m not in names]
        if missing:
            raise SystemExit(f"slim_wheel: not in {wheel.name}: {', '.join(missing)}")
        with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if info.filename in drop:
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(line for line in lines if line.split(",", 1)[0] not in drop).encode()
                dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--drop", nargs="+", default=list(DEFAULT_DROP),
                        help="members to leave out (default: %(default)s)")
    args = parser.parse_args(argv)
    target = slim(args.wheel, args.out_dir, tuple(args.drop))
    mib = 1 << 20
    print(f"{target}: {args.wheel.stat().st_size / mib:.0f} -> {target.stat().st_size / mib:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
