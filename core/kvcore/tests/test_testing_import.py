"""Without pytest or hypothesis, ``import kvcore.testing`` says how to get them; ``import kvcore`` never needs them."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("missing", ["pytest", "hypothesis"])
def test_missing_test_tools_name_the_extra(missing):
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "import kvcore\n"
        "try:\n"
        "    import kvcore.testing\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'kvcore[testing]'" in out and missing in out
