"""Prediction of what is read next: sequential readahead (hints and epoch structure: issue 4)."""
