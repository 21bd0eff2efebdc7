"""--streaming: rows read, checked and encoded as training consumes them.

For data larger than memory or the disk cache. Nothing is read or tokenised upfront: the
first step comes as soon as the shuffle buffer (datasets' IterableDataset.shuffle) is full.
Rows go through the same checks as without streaming (each file's format from its first
rows, the template, max_length and --truncation_strategy), but a bad row is found only when
training reaches it: it stops the run with its file:line, or with --skip_bad_rows is counted.
The counts of what was read, skipped, truncated and dropped are in StreamReport.

A stream has no length: --max_steps decides how long training runs, and at the end of the
data the next pass begins. Resuming from a checkpoint
continues from the same position: the Trainer skips the batches already trained on.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from swiftlite.data.encode import SFT_ENCODER, Counts, Encoder, check_truncation_strategy
from swiftlite.data.formats import BadRow
from swiftlite.data.files import open_rows, parse_spec
from swiftlite.data.loader import check_row, file_format
from swiftlite.data.template_base import ChatTemplate
from swiftlite.errors import UsageError

_BATCH = 64  # conversations per tokenizer call


@dataclass
class StreamReport(Counts):
    rows: int = 0  # rows read from the files (all passes)
    passes: int = 0  # passes begun over the files
    skipped: Counter = field(default_factory=Counter)  # bad rows, per reason

    def to_dict(self) -> dict:
        return {"rows": self.rows, "passes": self.passes, "skipped": dict(self.skipped),
                "samples": self.samples,
                "truncated": self.truncated, "dropped": dict(self.dropped)}

    def summary(self) -> str:
        bad = sum(self.skipped.values())
        return (f"{self.rows} rows read in {self.passes} pass(es), {bad} skipped" + (
            " (" + ", ".join(f"{n} {k}" for k, n in self.skipped.most_common()) + ")"
            if bad else "") + f" -> {self.samples} encoded; truncated: "
            f"{self.truncated}; dropped: " + (", ".join(
                f"{n} {k}" for k, n in self.dropped.items()) if self.dropped else "0"))


def check_specs(specs: list[str]) -> None:
    """What --streaming cannot do with these specs, before anything is read."""
    for spec in specs:
        path, n = parse_spec(spec)
        if n is not None:
            raise UsageError(f"--dataset {spec} with --streaming true: #N sampling needs every "
                             f"row before training starts. Give {path} without #{n} (a stream "
                             "is trained on for --max_steps), or use --streaming false.")


def samples(specs: list[str], template: ChatTemplate, report: StreamReport, *,
            max_length: int, truncation_strategy: str, skip_bad_rows: bool,
            model_name=None, model_author=None, encoder: Encoder = SFT_ENCODER,
            task: str = "sft", prepare=None):
    """The encoded samples (the encoder's columns: SFT's input_ids/labels, or data.pair_encode's
    pairs) of each usable row of the specs, in file order. prepare(rows) -> rows: what a task
    does to checked rows before they are encoded (KTO: split pairs into labelled rows)."""
    check_truncation_strategy(truncation_strategy)
    options = (template, report, max_length, truncation_strategy, skip_bad_rows, encoder,
               prepare)
    for spec in specs:
        path, _ = parse_spec(spec)
        raw_rows, _ = open_rows(path, model_name, model_author)
        fmt = file_format(raw_rows, skip_bad_rows, task)
        batch = []
        for where, row, _ in raw_rows():
            report.rows += 1
            try:
                batch.append(check_row(row, where, fmt))
            except BadRow as e:
                _bad(report, skip_bad_rows, where, str(e), e.kind)
                continue
            if len(batch) == _BATCH:
                yield from _encoded(batch, *options)
                batch = []
        yield from _encoded(batch, *options)


def _encoded(batch, template, report, max_length, strategy, skip_bad_rows, encoder, prepare):
    if not batch:
        return
    batch = prepare(batch) if prepare else batch
    columns, part = encoder.chunk(batch, template, max_length, strategy, "train")
    report.samples += part.samples
    report.truncated += part.truncated
    report.dropped.update(part.dropped)
    report.trained_tokens += part.trained_tokens
    if part.rejected and not skip_bad_rows:
        raise UsageError(f"{part.rejected[0]}. (--streaming checks each row when training "
                         "reaches it.) Fix it, or pass --skip_bad_rows true to leave bad rows "
                         "out (they are counted).")
    if columns:
        names = [c for c in columns if c != "length"]
        for values in zip(*(columns[c] for c in names)):
            yield dict(zip(names, values))


def _bad(report: StreamReport, skip_bad_rows: bool, where: str, why: str, kind) -> None:
    if not skip_bad_rows:
        raise UsageError(f"{where}: {why}. (--streaming checks each row when training reaches "
                         "it.) Fix it, or pass --skip_bad_rows true to leave bad rows out "
                         "(they are counted).")
    if kind is not None:
        report.skipped[kind] += 1


def stream_dataset(specs: list[str], template: ChatTemplate, *, seed: int, buffer_size: int,
                   **options):
    """(datasets.IterableDataset of the encoder's columns (SFT: input_ids/labels), shuffled
    with a buffer of buffer_size samples, StreamReport that counts as it is read). options:
    those of samples()."""
    import datasets
    check_specs(specs)
    report = StreamReport()

    def generate():
        # One endless pass after another: the Trainer counts a stream as one epoch of
        # --max_steps steps, and at the end of an epoch it never finishes a partial
        # accumulation (data smaller than one step would train forever without a step).
        key = 0
        while True:
            report.passes += 1
            start = key
            for sample in samples(specs, template, report, **options):
                yield key, sample
                key += 1
            if key == start:
                raise UsageError(f"the dataset {' '.join(specs)} has no usable rows "
                                 f"({report.summary()}).")

    # Not IterableDataset.from_generator: it hashes the generator with everything it refers
    # to (the tokenizer: seconds), to name a cache that a stream never writes.
    from datasets.iterable_dataset import ExamplesIterable
    columns = options.get("encoder", SFT_ENCODER).columns
    features = datasets.Features({
        c: datasets.Sequence(datasets.Value("int32")) if kind == "ids" else datasets.Value("int32")
        for c, kind in columns.items() if c != "length"})
    ds = datasets.IterableDataset(ExamplesIterable(lambda: generate(), {}),
                                  info=datasets.DatasetInfo(features=features))
    return ds.shuffle(seed=seed, buffer_size=buffer_size), report


def first_sample(specs: list[str], template: ChatTemplate, **options) -> dict:
    """The first usable sample of the specs (for the preview), read on its own; and each
    file's format from its first rows, so that a file of the wrong kind stops the run now,
    before a model loads, rather than when the stream reaches it."""
    check_specs(specs)
    for spec in specs:
        raw_rows, _ = open_rows(parse_spec(spec)[0], options.get("model_name"),
                                options.get("model_author"))
        file_format(raw_rows, options.get("skip_bad_rows", False), options.get("task", "sft"))
    for sample in samples(specs, template, StreamReport(), **options):
        return sample
    raise UsageError(f"the dataset {' '.join(specs)} has no usable rows.")
