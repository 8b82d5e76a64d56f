"""Writes: dirty files in a write tier, their journal, and write-back to the backing store."""
