"""kv_lab — research tooling of the kvcompress methods, kept out of their runtime wheels.

Subpackages
-----------
sekv    SEKV router training (§3.4): teacher pass, straight-through attention, loss and loop; ``kv-sekv`` CLI
hqekv   HqeKV's tier-share search (Alg. 1, TPE) and its calibration loss; ``kv-hqekv`` CLI
hubkv   HubKV's theory (F_sub, greedy oracle, Prop. 3 bounds) and Appendix I diagnostics

kv-lab sits on top of the workspace: it imports the method packages (``kv_sekv``, ``kv_hqekv``, ``kv_hubkv``) and
the integrations (``kv_hf``, ``kvbench``), and nothing imports it.
"""
