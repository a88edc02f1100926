import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("CXLKV_BIN", str(ROOT / "target" / "debug" / "cxlkv"))
VENV_BIN = pathlib.Path(sys.executable).parent
# Helpers are shared with the plugin tests.
sys.path.insert(0, str(ROOT / "python" / "tests"))
