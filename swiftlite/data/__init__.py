"""Datasets: read files and built-ins, detect and normalise formats, encode and cache."""
from swiftlite.data.formats import FORMATS, detect_format, to_conversation, to_messages
from swiftlite.data.files import BUILTIN, parse_spec
from swiftlite.data.loader import LoadReport, load_conversations, load_datasets

__all__ = ["BUILTIN", "FORMATS", "LoadReport", "detect_format", "load_conversations",
           "load_datasets", "parse_spec", "to_conversation", "to_messages"]
