"""Puts this folder on ``sys.path`` for the shared ``sglang_env`` helper (pytest runs with importlib import mode)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
