"""Only the optional C extension lives here; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # Streaming-store copies (cxlkv_lmcache/_copy.c). Optional: without a C
        # compiler the package installs and falls back to ctypes.memmove.
        Extension("cxlkv_lmcache._copy", ["cxlkv_lmcache/_copy.c"], optional=True, extra_compile_args=["-O2"]),
    ]
)
