"""The workspace runs pytest with ``--import-mode=importlib``; make the toy helpers importable as ``kvcore_toys``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
