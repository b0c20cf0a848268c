"""Stand-in for tests (see ../README.md)."""
