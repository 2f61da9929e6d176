"""Counting tokens: offline tiktoken encodings, bounded-cost counting, the fair scheduler."""
