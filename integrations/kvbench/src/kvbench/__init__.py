"""Benchmarks for the transformers adapter."""
