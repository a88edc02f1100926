"""The plugin as it ships: the platform wheel (with the copy extension) these
tests run against, the sdist that installs without a C compiler, and the
pure-Python wheel. scripts/test-python.sh builds them into $CXLKV_DIST."""

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest

import cxlkv_lmcache

ROOT = pathlib.Path(__file__).resolve().parents[2]
DIST = pathlib.Path(os.environ["CXLKV_DIST"]) if os.environ.get("CXLKV_DIST") else None
pytestmark = pytest.mark.skipif(DIST is None, reason="run by scripts/test-python.sh, which builds the wheel")


def only(pattern: str, where: pathlib.Path | None = None) -> pathlib.Path:
    found = sorted((where or DIST).glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {where or DIST}, got {found}"
    return found[0]


def metadata(wheel: pathlib.Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def copy_routine_when_installed_alone(wheel_or_sdist: pathlib.Path, tmp_path: pathlib.Path, **env) -> str:
    """Install into a directory of its own (dependencies from this venv) and
    report which copy routine the installed package picks."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir", "--target",
                    str(target), str(wheel_or_sdist)], check=True, env={**os.environ, **env})
    out = subprocess.run([sys.executable, "-c", "import cxlkv_lmcache, cxlkv_lmcache.client as c; "
                          "print(cxlkv_lmcache.__file__); print(c.COPY)"], check=True, capture_output=True,
                         text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(target)})
    where, kind = out.stdout.split()
    assert pathlib.Path(where).is_relative_to(target)
    return kind


def test_the_tests_run_against_the_installed_wheel():
    here = pathlib.Path(cxlkv_lmcache.__file__).resolve()
    assert not here.is_relative_to(ROOT / "python"), f"imported from the source tree: {here}"
    dist = importlib.metadata.distribution("cxlkv-lmcache")
    assert dist.version == cxlkv_lmcache.__version__
    wheel = only("cxlkv_lmcache-*-cp*.whl")
    assert wheel.name.startswith(f"cxlkv_lmcache-{dist.version}-")
    assert any(f.name.startswith("_copy.") and f.suffix == ".so" for f in dist.files), "extension not installed"


def test_the_platform_wheel_carries_the_extension_and_states_the_lmcache_it_supports():
    wheel = only("cxlkv_lmcache-*-cp*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert any(n.startswith("cxlkv_lmcache/_copy.") and n.endswith(".so") for n in names)
    assert "cxlkv_lmcache/_proto/cxlkv_pb2_grpc.py" in names
    assert not [n for n in names if n.endswith(".c")]
    meta = metadata(wheel)
    # The supported LMCache is the one the tests run with and the venv pins.
    lmcache = importlib.metadata.version("lmcache")
    assert f'Requires-Dist: lmcache=={lmcache}; extra == "lmcache"' in meta, meta
    assert f"lmcache=={lmcache}" in (ROOT / "scripts" / "setup-python.sh").read_text()
    assert f"Supported LMCache: {lmcache}" in meta
    assert "Requires-Python: " in meta


def test_the_sdist_installs_without_a_compiler(tmp_path):
    sdist = only("cxlkv_lmcache-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "README.md", "cxlkv_lmcache/_copy.c"} <= names
    assert not [n for n in names if n.startswith("tests/")]
    # CC=false: every compile fails, the optional extension is left out.
    assert copy_routine_when_installed_alone(sdist, tmp_path, CC="false") == "memmove"


def test_the_pure_wheel_needs_no_compiler(tmp_path):
    wheel = only("cxlkv_lmcache-*-py3-none-any.whl", DIST / "pure")
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if n.endswith((".so", ".c"))]
    assert copy_routine_when_installed_alone(wheel, tmp_path) == "memmove"
