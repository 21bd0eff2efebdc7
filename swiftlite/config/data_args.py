"""The data group: datasets, lengths, bad rows, sampling, streaming and packing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg


@dataclass
class DataArguments:
    dataset: list[str] = arg(help="files (.jsonl/.json/.csv/.parquet) or built-ins "
                             "(self-cognition), each optionally NAME#N to sample N rows",
                             factory=list, group="data")
    val_dataset: list[str] = arg(help="validation files or built-ins (same syntax)",
                                 factory=list, group="data")
    split_dataset_ratio: float = arg(0.0, "share of --dataset held out for validation",
                                     group="data")
    max_length: int = arg(2048, "longest sample in tokens (see --truncation_strategy)",
                          group="data")
    truncation_strategy: str = arg("delete", "over-long samples: delete them, or cut from the "
                                   "left/right (counts are always printed)",
                                   choices=("delete", "left", "right"), group="data")
    skip_bad_rows: bool = arg(False, "skip malformed rows (counted per reason) instead of "
                              "stopping", group="data")
    dataset_num_proc: Optional[int] = arg(None, "processes that tokenise (default: the CPU "
                                          "cores this process may use)", group="data")
    loss_scale: str = arg("default", "what is trained: default every assistant reply (tool "
                          "calls included), last_round only the last one, all every token "
                          "(prompt too); a message's own \"loss\": true|false decides for it",
                          choices=("default", "last_round", "all"), group="data")
    model_name: list[str] = arg(help="name for self-cognition: English [Chinese]",
                                factory=list, group="data")
    model_author: list[str] = arg(help="author for self-cognition: English [Chinese]",
                                  factory=list, group="data")
    data_seed: int = arg(42, "seed for dataset sampling (#N) and splitting", group="data")
    load_from_cache_file: bool = arg(True, "reuse tokenised data cached on disk", group="data")
    streaming: bool = arg(False, "read and tokenise rows as training consumes them, nothing "
                          "upfront (data larger than memory; needs --max_steps)", group="data")
    shuffle_buffer_size: int = arg(1000, "--streaming: samples in the shuffle buffer",
                                   group="data")
    packing: bool = arg(False, "pack samples into rows of up to --max_length tokens (fewer, "
                        "fuller steps; attention stays inside each sample)", group="data")
