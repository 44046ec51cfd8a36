"""HubKV's analysis tools (paper §2.3, §3.1–3.2, Appendices I and J), kept out of the kv-hubkv runtime wheel.

theory        F_sub, marginal gains, overlap ratio, greedy oracle and brute force, Prop. 3 bounds (Appendix J)
diagnostics   Appendix I diagnostics on captured scores (Observations 1–3)

The refinement itself (``kv_hubkv.refine``, ``kv_hubkv.hubkv``) stays in kv-hubkv.
"""

from . import diagnostics, theory

__all__ = ["diagnostics", "theory"]
