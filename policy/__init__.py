"""Sluice's policy engine: pure functions over plain data (no I/O)."""
