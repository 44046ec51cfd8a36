"""ByteCounts: one definition of compression and saved bytes for every metrics record."""

from dataclasses import dataclass

import kvpages


@dataclass
class _Record(kvpages.ByteCounts):
    stored_bytes: int = 0
    fp16_bytes: int = 0


def test_compression_and_saved_bytes():
    assert _Record().compression == 0.0 and _Record().saved_bytes == 0  # nothing saved yet: no division by zero
    r = _Record(stored_bytes=25, fp16_bytes=100)
    assert r.compression == 4.0 and r.saved_bytes == 75
    assert _Record(stored_bytes=110, fp16_bytes=100).saved_bytes == -10  # lossless framing costs bytes
    assert r.byte_summary() == {"compression": 4.0, "saved_bytes": 75}


def test_cache_metrics_report_them():
    m = kvpages.CacheMetrics(saves=1, stored_bytes=50, fp16_bytes=200)
    d = m.as_dict()
    assert d["compression"] == 4.0 and d["saved_bytes"] == 150 and d["saves"] == 1
