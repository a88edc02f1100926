"""LMCache L2 adapter backed by the cxlkv sidecar (CXL shared-memory pool).

Load it with::

    --l2-adapter '{"type": "plugin", "module_path": "cxlkv_lmcache.adapter",
                   "class_name": "CxlKvL2Adapter",
                   "adapter_params": {"socket": "/run/cxlkv/cxlkv.sock"}}'
"""

__version__ = "0.1.0"
