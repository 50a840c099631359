"""An org's own datasets: where they may live, what they hold, and whether a run can use one.

A run spec never names a path. It says what data it needs (:class:`DataSpec`: a kind
such as ``table`` or ``image-folder``, and for a table the columns it reads and their
types). Each org registers its own datasets with its node (``/v1/datasets``); the node
confines each path to the configured dataset roots (:func:`confine`), hashes the
content (:func:`content_hash`) and, for a CSV or Parquet table, reads its columns,
their types and its row count (:func:`inspect_dataset`). Accepting a run binds one
registered dataset to it (:class:`DatasetBinding`) once :func:`mismatches` finds
nothing wrong; the trainer receives that binding, and the privacy report names its
id, content hash and rows. Nothing here is ever sent to a peer.

Column types are ``int``, ``float``, ``bool`` and ``str`` (inferred from a CSV's
values, or read from a Parquet schema); a spec may also ask for ``number`` (``int`` or
``float``) or ``any``. An ``int`` column satisfies ``float``; every column satisfies
``str`` and ``any``.
"""

from __future__ import annotations

import csv
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "COLUMN_TYPES",
    "DATASET_KINDS",
    "OUTSIDE",
    "SPEC_TYPES",
    "TABLE_SUFFIXES",
    "DataSpec",
    "DataSpecError",
    "DatasetBinding",
    "DatasetError",
    "PathRefused",
    "compatible",
    "confine",
    "content_hash",
    "detect_kind",
    "inspect_dataset",
    "inspect_table",
    "mismatches",
]

DATASET_KINDS = ("table", "image-folder", "files")
"""``table``: one CSV or Parquet file; ``image-folder``: a directory of class
subdirectories holding images; ``files``: anything else (the trainer reads it)."""
COLUMN_TYPES = ("int", "float", "bool", "str")
SPEC_TYPES = (*COLUMN_TYPES, "number", "any")
TABLE_SUFFIXES = (".csv", ".parquet")
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"})
_CHUNK = 1 << 20
_MAX_COLUMNS = 10_000


class DatasetError(ValueError):
    """A dataset that cannot be read or described (the message says why, in one line)."""


class PathRefused(DatasetError):
    """A dataset path outside the roots, missing, or unreadable (message says which)."""


class DataSpecError(ValueError):
    """A run spec's ``data`` requirement that is malformed."""


@dataclass(frozen=True)
class DataSpec:
    """What a run needs of every participant's data; never a path.

    kind: one of :data:`DATASET_KINDS`.
    columns: for a table, the columns the trainer reads and their types (one of
        :data:`SPEC_TYPES`); a dataset may hold more columns.
    min_rows: the fewest rows (or files) a bound dataset may hold.
    """

    kind: str = "table"
    columns: Mapping[str, str] = field(default_factory=dict)
    min_rows: int = 1

    def __post_init__(self) -> None:
        if self.kind not in DATASET_KINDS:
            raise DataSpecError(
                f"data.kind must be one of {', '.join(DATASET_KINDS)}, not {self.kind!r}"
            )
        if not isinstance(self.columns, Mapping) or len(self.columns) > _MAX_COLUMNS:
            raise DataSpecError(f"data.columns must map at most {_MAX_COLUMNS} names to types")
        for name, typ in self.columns.items():
            if not isinstance(name, str) or not 0 < len(name) <= 200:
                raise DataSpecError(f"data.columns: {name!r} is not a column name")
            if typ not in SPEC_TYPES:
                raise DataSpecError(
                    f"data.columns[{name!r}]: type must be one of {', '.join(SPEC_TYPES)}, "
                    f"not {typ!r}"
                )
        if self.columns and self.kind != "table":
            raise DataSpecError("data.columns only applies to kind 'table'")
        if isinstance(self.min_rows, bool) or not isinstance(self.min_rows, int):
            raise DataSpecError("data.min_rows must be an integer")
        if self.min_rows < 0:
            raise DataSpecError("data.min_rows must be >= 0")
        object.__setattr__(self, "columns", dict(self.columns))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DataSpec:
        if not isinstance(values, Mapping):
            raise DataSpecError("data must be an object")
        unknown = sorted(set(values) - {"kind", "columns", "min_rows"})
        if unknown:
            raise DataSpecError(f"data: unknown key {unknown[0]!r}")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "columns": dict(self.columns), "min_rows": self.min_rows}


@dataclass(frozen=True)
class DatasetBinding:
    """The registered dataset an org bound to a run when it accepted it.

    id / name: the dataset's row at this org. path: its real path (local only).
    kind / columns / rows: what it holds. sha256: its content hash at binding time.
    """

    id: int
    name: str
    path: str
    kind: str
    columns: Mapping[str, str]
    rows: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "path": self.path,
            "kind": self.kind,
            "columns": dict(self.columns),
            "rows": self.rows,
            "sha256": self.sha256,
        }

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DatasetBinding:
        return cls(
            id=int(values["id"]),
            name=str(values["name"]),
            path=str(values["path"]),
            kind=str(values["kind"]),
            columns={str(k): str(v) for k, v in dict(values["columns"]).items()},
            rows=int(values["rows"]),
            sha256=str(values["sha256"]),
        )


def compatible(required: str, actual: str) -> bool:
    """Whether a column of type ``actual`` satisfies a requirement of type ``required``."""
    if required in ("any", "str"):
        return True
    if required == "number":
        return actual in ("int", "float")
    if required == "float":
        return actual in ("int", "float")
    return required == actual


def mismatches(spec: DataSpec, kind: str, columns: Mapping[str, str], rows: int) -> list[str]:
    """Every way a dataset of ``kind``, ``columns`` and ``rows`` falls short of ``spec``."""
    out: list[str] = []
    if kind != spec.kind:
        out.append(f"the run needs a {spec.kind!r} dataset, this one is {kind!r}")
        return out
    for name, required in spec.columns.items():
        if name not in columns:
            out.append(f"column {name!r} ({required}) is missing")
        elif not compatible(required, columns[name]):
            out.append(f"column {name!r} is {columns[name]}, the run needs {required}")
    if rows < spec.min_rows:
        out.append(f"it has {rows} rows, the run needs at least {spec.min_rows}")
    return out


# --------------------------------------------------------------------------- paths


def _real_roots(roots: Sequence[Path]) -> list[Path]:
    return [Path(os.path.realpath(r)) for r in roots]


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


OUTSIDE = "path is outside the configured dataset roots"
"""The one answer for any path that leads outside the roots, existing or not."""


def confine(raw: str, roots: Sequence[Path]) -> Path:
    """The real path of ``raw`` if it exists under one of ``roots``; else PathRefused.

    ``raw`` is absolute, or relative to a root; every symlink is followed, so ``..``
    and links pointing outside the roots are refused alike. A path that leads outside
    the roots is refused with :data:`OUTSIDE` before its existence is looked at, so the
    answer never tells whether a file exists outside them.
    """
    if not roots:
        raise PathRefused(
            "no dataset roots are configured on this node: add one to [datasets] roots "
            "in its fedweave.toml (DATA_DIR/datasets is the default)"
        )
    if "\x00" in raw or not raw.strip():
        raise PathRefused("invalid path")
    real_roots = _real_roots(roots)
    given = Path(raw)
    candidates = [given] if given.is_absolute() else [r / given for r in roots]
    for candidate in candidates:
        # where the path leads, whether or not it exists: a path outside the roots gets
        # one answer, never one that says whether something is there (no oracle)
        try:
            leads = Path(os.path.realpath(candidate))
        except (OSError, RuntimeError, ValueError):
            continue
        if not _inside(leads, real_roots):
            raise PathRefused(OUTSIDE)
        try:
            real = Path(os.path.realpath(candidate, strict=True))
        except (OSError, RuntimeError):
            continue
        if not _inside(real, real_roots):
            raise PathRefused(OUTSIDE)
        if not (real.is_file() or real.is_dir()):
            raise PathRefused("path is neither a regular file nor a directory")
        return real
    raise PathRefused("no such file or directory under the dataset roots")


def _hash_file(path: Path, h: Any) -> None:
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)


def content_hash(path: Path, roots: Sequence[Path]) -> str:
    """SHA-256 of a file's bytes, or of a directory tree.

    For a directory: for every regular file in sorted relative-path order, the UTF-8
    relative path, a NUL, the file's SHA-256 (hex) and a newline are hashed. A symlink
    inside the tree that points outside the roots is refused.
    """
    real_roots = _real_roots(roots)
    try:
        if path.is_file():
            h = hashlib.sha256()
            _hash_file(path, h)
            return h.hexdigest()
        outer = hashlib.sha256()
        files: list[tuple[str, Path]] = []
        for dirpath, _dirs, names in os.walk(path, followlinks=False):
            for name in names:
                p = Path(dirpath) / name
                real = Path(os.path.realpath(p))
                if not _inside(real, real_roots):
                    raise PathRefused(f"{p.relative_to(path)} links outside the dataset roots")
                if real.is_file():
                    files.append((p.relative_to(path).as_posix(), real))
        for rel, real in sorted(files):
            h = hashlib.sha256()
            _hash_file(real, h)
            outer.update(rel.encode("utf-8") + b"\x00" + h.hexdigest().encode() + b"\n")
        return outer.hexdigest()
    except OSError as exc:
        raise PathRefused(f"cannot read the dataset: {exc.strerror or 'I/O error'}") from None


# --------------------------------------------------------------------------- content


def detect_kind(path: Path) -> str:
    """``table`` for a ``.csv``/``.parquet`` file, ``image-folder`` for a directory whose
    subdirectories hold images only, ``files`` otherwise."""
    if path.is_file():
        return "table" if path.suffix.lower() in TABLE_SUFFIXES else "files"
    subdirs = [p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if not subdirs:
        return "files"
    for sub in subdirs:
        files = [p for p in sub.iterdir() if p.is_file() and not p.name.startswith(".")]
        if not files or any(p.suffix.lower() not in IMAGE_SUFFIXES for p in files):
            return "files"
    return "image-folder"


def _cell_type(value: str) -> str | None:
    """The narrowest type of one CSV cell; None for an empty cell."""
    text = value.strip()
    if not text:
        return None
    try:
        int(text)
        return "int"
    except ValueError:
        pass
    try:
        float(text)
        return "float"
    except ValueError:
        pass
    return "bool" if text.lower() in ("true", "false") else "str"


def _widen(current: str | None, new: str | None) -> str | None:
    if new is None or current == new:
        return current
    if current is None:
        return new
    if {current, new} == {"int", "float"}:
        return "float"
    return "str"


def _inspect_csv(path: Path) -> tuple[dict[str, str], int]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header:
                raise DatasetError(f"{path.name} has no header row")
            names = [h.strip() for h in header]
            if any(not n for n in names) or len(set(names)) != len(names):
                raise DatasetError(f"{path.name}: column names must be non-empty and distinct")
            if len(names) > _MAX_COLUMNS:
                raise DatasetError(f"{path.name} has more than {_MAX_COLUMNS} columns")
            types: list[str | None] = [None] * len(names)
            rows = 0
            for rows, record in enumerate(reader, start=1):
                if len(record) != len(names):
                    raise DatasetError(
                        f"{path.name}: row {rows} has {len(record)} fields, the header {len(names)}"
                    )
                for i, cell in enumerate(record):
                    types[i] = _widen(types[i], _cell_type(cell))
    except UnicodeDecodeError:
        raise DatasetError(f"{path.name} is not UTF-8 text") from None
    except csv.Error as exc:
        raise DatasetError(f"{path.name} is not a readable CSV file: {exc}") from None
    return {n: t or "str" for n, t in zip(names, types, strict=True)}, rows


def _parquet_type(arrow_type: Any) -> str:
    import pyarrow as pa

    if pa.types.is_boolean(arrow_type):
        return "bool"
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_floating(arrow_type) or pa.types.is_decimal(arrow_type):
        return "float"
    return "str"


def _inspect_parquet(path: Path) -> tuple[dict[str, str], int]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DatasetError(f"{path.name} is not a readable Parquet file: {exc}") from None
    schema = meta.schema_arrow
    return {f.name: _parquet_type(f.type) for f in schema}, int(meta.metadata.num_rows)


def inspect_table(path: Path) -> tuple[dict[str, str], int]:
    """The columns (name -> type) and the row count of a CSV or Parquet file."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return _inspect_csv(path)
    if suffix == ".parquet":
        return _inspect_parquet(path)
    raise DatasetError(f"{path.name} is neither a .csv nor a .parquet file")


def inspect_dataset(path: Path, kind: str | None = None) -> tuple[str, dict[str, str], int]:
    """``(kind, columns, rows)`` of the dataset at ``path``.

    A table's columns and rows are read from the file; an image folder counts its
    images (no columns); ``files`` counts the regular files. ``kind`` given and
    different from what the content is, is a DatasetError.
    """
    found = detect_kind(path)
    if kind is not None and kind != found:
        if kind not in DATASET_KINDS:
            raise DatasetError(f"kind must be one of {', '.join(DATASET_KINDS)}, not {kind!r}")
        if not (kind == "files" and found != "table"):
            raise DatasetError(f"{path.name} is a {found!r} dataset, not {kind!r}")
        found = kind
    if found == "table":
        columns, rows = inspect_table(path)
        return found, columns, rows
    if path.is_file():
        return found, {}, 1
    count = sum(
        1 for _dir, _sub, names in os.walk(path) for name in names if not name.startswith(".")
    )
    return found, {}, count
