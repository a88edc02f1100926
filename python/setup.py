"""Only the optional C extension lives here; everything else is in pyproject.toml."""

import os

from setuptools import Extension, setup

# Streaming-store copies (cxlkv_lmcache/_copy.c). Optional: without a C compiler
# the package still builds and installs, and falls back to ctypes.memmove.
# CXLKV_LMCACHE_PURE=1 leaves it out on purpose: the wheel is then pure Python
# (py3-none-any), for hosts no platform wheel fits and that have no compiler.
ext_modules = []
if os.environ.get("CXLKV_LMCACHE_PURE", "") not in ("1", "true", "yes"):
    ext_modules.append(
        Extension("cxlkv_lmcache._copy", ["cxlkv_lmcache/_copy.c"], optional=True, extra_compile_args=["-O2"]))

setup(ext_modules=ext_modules)
