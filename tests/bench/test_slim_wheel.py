"""The staging's wheel slimmer (benchmarks/gpu/staging/slim_wheel.py) on a small wheel: the dropped member and its
RECORD line are gone, every other member is byte-identical, pip installs the result, and a wrong name is refused."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAME = "toy-1.0-py3-none-any.whl"
DROP = "toy/_big.so"
MEMBERS = {
    "toy/__init__.py": b"VALUE = 7\n",
    DROP: b"\x7fELF" + bytes(4096),
    "toy-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: toy\nVersion: 1.0\n",
    "toy-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}


def _slim_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("slim_wheel", ROOT / "benchmarks/gpu/staging/slim_wheel.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toy_wheel(folder: Path) -> Path:
    folder.mkdir()
    path = folder / NAME
    record = "".join(f"{name},," + "\n" for name in MEMBERS) + "toy-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in MEMBERS.items():
            wheel.writestr(name, data)
        wheel.writestr("toy-1.0.dist-info/RECORD", record)
    return path


def test_the_slim_copy_lacks_the_member_and_its_record_line_and_installs(tmp_path: Path) -> None:
    slim = _slim_module()
    out = slim.slim(_toy_wheel(tmp_path / "src"), tmp_path / "out", (DROP,))
    assert out.name == NAME
    with zipfile.ZipFile(out) as wheel:
        assert DROP not in wheel.namelist()
        for name, data in MEMBERS.items():
            if name != DROP:
                assert wheel.read(name) == data
        record = wheel.read("toy-1.0.dist-info/RECORD").decode()
    assert DROP not in record and "toy/__init__.py,," in record
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(out)], check=True)
    assert (target / "toy" / "__init__.py").read_bytes() == MEMBERS["toy/__init__.py"]
    assert not (target / "toy" / "_big.so").exists()


def test_a_member_the_wheel_lacks_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    slim = _slim_module()
    with pytest.raises(SystemExit, match=r"not in toy-1\.0"):
        slim.slim(_toy_wheel(tmp_path / "src"), tmp_path / "out", ("toy/_absent.so",))
    assert not (tmp_path / "out" / NAME).exists()
