"""Input files and the documents in them: text, JSONL, Parquet, or a `datasets` dataset on disk.

An INPUT is a local file, a directory (every file under it, by name), a glob, or an s3:// prefix
(optionally ending in a glob), expanded in the order given and by name within each. s3:// objects
are downloaded first, so every reader reads local files. Documents come out in a fixed order,
which is what makes the prepared output the same whatever the number of workers.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from launcher.data import s3
from launcher.errors import UsageError

FORMATS = ("text", "jsonl", "parquet", "arrow")
SUFFIX_FORMATS = {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
DATASETS_STATE = "state.json"  # what `datasets.Dataset.save_to_disk` writes beside its arrow files
PYARROW_MISSING = "reading {format} needs pyarrow; install the data extra: pip install 'launcher[data]'"


@dataclass(frozen=True)
class InputFile:
    uri: str
    """As the user named it (a path or an s3:// URI)."""
    path: Path
    """Where it is read: the file itself, or its download."""
    format: str


def expand(inputs: list[str], *, format: str, downloads: Path) -> list[InputFile]:
    """Every input file, in order, each with its format ("auto": from the file name)."""
    files: list[InputFile] = []
    for given in inputs:
        found = _expand_s3(given, downloads / str(len(files))) if given.startswith("s3://") else _expand_local(given)
        if not found:
            raise UsageError(f"INPUT {given}: no files found; give files, a directory, a glob or an s3:// prefix")
        files += [InputFile(uri, path, _format_of(path, format)) for uri, path in found]
    return files


def _expand_local(given: str) -> list[tuple[str, Path]]:
    if any(c in given for c in s3.GLOB_CHARS):
        return [(p, Path(p)) for p in sorted(glob.glob(given, recursive=True)) if Path(p).is_file()]
    path = Path(given)
    if path.is_file():
        return [(given, path)]
    if not path.is_dir():
        raise UsageError(f"INPUT {given}: does not exist; give files, a directory, a glob or an s3:// prefix")
    if (path / DATASETS_STATE).is_file():
        return [(str(p), p) for p in _datasets_files(path)]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.parts))
    return [(str(p), p) for p in files]


def _datasets_files(directory: Path) -> list[Path]:
    try:
        state = json.loads((directory / DATASETS_STATE).read_text())
        return [directory / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(
            f"INPUT {directory}: {DATASETS_STATE} does not list the dataset's arrow files ({error})"
        ) from None


def _expand_s3(given: str, downloads: Path) -> list[tuple[str, Path]]:
    bucket, _ = s3.split(given)
    found = []
    for number, key in enumerate(s3.list_keys(given)):
        target = downloads / f"{number:06d}-{Path(key).name}"
        s3.download(bucket, key, target)
        found.append((f"s3://{bucket}/{key}", target))
    return found


def _format_of(path: Path, format: str) -> str:
    if format != "auto":
        return format
    return SUFFIX_FORMATS.get(path.suffix.lower(), "text")


def documents(file: InputFile, *, field: str, delimiter: str | None) -> Iterator[str]:
    """The non-empty documents of one file, in order."""
    if file.format == "text":
        yield from _text_documents(file, delimiter)
    elif file.format == "jsonl":
        yield from _jsonl_documents(file, field)
    else:
        yield from _arrow_documents(file, field)


def _text_documents(file: InputFile, delimiter: str | None) -> Iterator[str]:
    try:
        text = file.path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(
            f"INPUT {file.uri}: not UTF-8 text (byte {error.start}); give --format for other files"
        ) from None
    yield from (doc for doc in (text.split(delimiter) if delimiter else [text]) if doc)


def _jsonl_documents(file: InputFile, field: str) -> Iterator[str]:
    try:
        yield from _jsonl_lines(file, field)
    except UnicodeDecodeError as error:
        raise UsageError(f"INPUT {file.uri}: not UTF-8 text ({error.reason}); JSONL files are UTF-8") from None


def _jsonl_lines(file: InputFile, field: str) -> Iterator[str]:
    with file.path.open(encoding="utf-8", errors="strict") as stream:
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise UsageError(f"INPUT {file.uri}:{number}: not a JSON object ({error})") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                fields = ", ".join(record) if isinstance(record, dict) else "none"
                raise UsageError(
                    f"INPUT {file.uri}:{number}: no text field {field!r}; name it with --field (this line has: {fields})"
                )
            if text:
                yield text


def _arrow_documents(file: InputFile, field: str) -> Iterator[str]:
    try:
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise UsageError(PYARROW_MISSING.format(format=file.format)) from None
    try:
        if file.format == "parquet":
            reader = pyarrow.parquet.ParquetFile(file.path)
            names, batches = reader.schema_arrow.names, lambda: reader.iter_batches(columns=[field], batch_size=1024)
        else:
            names, batches = _open_arrow(file.path)
        if field not in names:
            raise UsageError(
                f"INPUT {file.uri}: no column {field!r}; name the text column with --field (columns: {', '.join(names)})"
            )
        for batch in batches():
            yield from (text for text in batch.column(field).to_pylist() if text)
    except pyarrow.ArrowException as error:
        raise UsageError(f"INPUT {file.uri}: not a readable {file.format} file ({error})") from None


def _open_arrow(path: Path):
    """(column names, a function giving the record batches). `datasets` writes the Arrow IPC stream
    format; other .arrow files are often the random-access file format."""
    import pyarrow.ipc

    try:
        stream = pyarrow.ipc.open_stream(pyarrow.memory_map(str(path)))
        return stream.schema.names, lambda: iter(stream)
    except pyarrow.ArrowInvalid:
        reader = pyarrow.ipc.open_file(pyarrow.memory_map(str(path)))
        return reader.schema.names, lambda: (reader.get_batch(i) for i in range(reader.num_record_batches))
