"""The transaction scheduler: the only code that does data I/O on the backing store."""
