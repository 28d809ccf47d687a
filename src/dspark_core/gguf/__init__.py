"""Drafter metadata read from a GGUF file (through gguf-py)."""
