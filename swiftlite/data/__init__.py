"""Datasets: read files and built-ins, detect and normalise formats, encode and cache."""
from swiftlite.data.formats import FORMATS, detect_format, to_conversation, to_messages
from swiftlite.data.loader import (BUILTIN, LoadReport, load_conversations, load_datasets,
                                   parse_spec)

__all__ = ["BUILTIN", "FORMATS", "LoadReport", "detect_format", "load_conversations",
           "load_datasets", "parse_spec", "to_conversation", "to_messages"]
