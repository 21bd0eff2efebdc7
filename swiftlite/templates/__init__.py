"""Chat templates as data files (one JSON file per template family)."""
