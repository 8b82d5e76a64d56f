"""Data-loading helpers for training on tierfs: access hints, sampling and collation."""
