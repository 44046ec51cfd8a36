"""kv_baselines."""
