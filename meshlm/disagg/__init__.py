"""Disaggregated prefill: one server computes long prompts' KV, another receives it and decodes."""
