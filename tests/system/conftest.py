import pathlib
import sys

from cxlkv_testkit import BIN, ROOT  # noqa: F401 - the paths every system test uses

VENV_BIN = pathlib.Path(sys.executable).parent
