"""The pool mapping registered with CUDA, where CUDA is present.

A memory object the in-process backend hands LMCache views pool pages; with
the whole mapping registered (cudaHostRegister, as Maru registers its
regions), LMCache's GPU connector reads a hit with one DMA from the pool to
the GPU instead of a CPU copy into pinned memory first. A host without CUDA
(or a torch built without it) skips this and works unchanged.
"""

from __future__ import annotations

import logging

log = logging.getLogger("cxlkv_lmcache")


def _cudart():
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        return torch.cuda.cudart()
    except Exception:  # a torch without CUDA support, a broken driver
        return None


def register(addr: int, size: int) -> bool:
    """cudaHostRegister the range; False where CUDA is absent or refuses."""
    rt = _cudart()
    if rt is None or size <= 0:
        return False
    try:
        rc = rt.cudaHostRegister(addr, size, 0)
    except Exception as e:
        log.warning("cxlkv: cudaHostRegister of the pool mapping failed: %s", e)
        return False
    if int(getattr(rc, "value", rc)) != 0:
        log.warning("cxlkv: cudaHostRegister of the pool mapping returned %s; GPU loads copy through the CPU", rc)
        return False
    log.info("cxlkv: pool mapping (%d bytes) registered with CUDA", size)
    return True


def unregister(addr: int) -> None:
    rt = _cudart()
    if rt is None:
        return
    try:
        rt.cudaHostUnregister(addr)
    except Exception as e:
        log.warning("cxlkv: cudaHostUnregister failed: %s", e)
