"""kvcodec.scratch: per-thread working buffers reused across calls."""

import threading

import torch

from kvcodec.scratch import scratch


def test_scratch_is_reused_grown_and_separate_per_name_dtype_and_thread():
    """A second call with the same (name, dtype, device) reuses the buffer's memory; a larger request grows it
    (fresh memory, then reused again); other names, dtypes and threads get their own buffers."""
    a = scratch("t_reuse", 100, torch.float32, torch.device("cpu"))
    assert a.shape == (100,) and a.dtype == torch.float32
    b = scratch("t_reuse", 60, torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and b.numel() == 60
    c = scratch("t_reuse", 1000, torch.float32, torch.device("cpu"))
    assert c.numel() == 1000
    assert scratch("t_reuse", 10, torch.float32, torch.device("cpu")).data_ptr() == c.data_ptr()
    assert scratch("t_other", 10, torch.float32, torch.device("cpu")).data_ptr() != c.data_ptr()
    assert scratch("t_reuse", 10, torch.int32, torch.device("cpu")).data_ptr() != c.data_ptr()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(scratch("t_reuse", 10, torch.float32, "cpu").data_ptr()))
    thread.start()
    thread.join()
    assert seen and seen[0] != c.data_ptr()
