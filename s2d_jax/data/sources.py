"""Reading local training files: ShareGPT rows (via `datasets`) and plain-text documents."""

from __future__ import annotations

import json
import os
import re

from s2d_jax.errors import S2DError
from s2d_jax.readers import parse_json, read_text

RECORD_EXTS = (".json", ".jsonl", ".parquet")
TEXT_EXTS = (".txt",)
# Documents in a text corpus: paragraphs (blank-line separated) and TinyStories-style
# "<|endoftext|>" separators.
_DOC_SPLIT = re.compile(r"\n[ \t]*\n|<\|endoftext\|>")


def file_format(path: str, fmt: str) -> str:
    """"sharegpt" or "text" for `path`, from `fmt` or (fmt="auto") its extension."""
    if fmt != "auto":
        return fmt
    ext = os.path.splitext(path)[1].lower()
    if ext in RECORD_EXTS:
        return "sharegpt"
    if ext in TEXT_EXTS:
        return "text"
    raise S2DError(f"cannot tell the format of {path} from its extension; use .json/.jsonl/"
                   ".parquet (ShareGPT) or .txt (text), or set data.format")


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        raise S2DError(f"data file {path} does not exist; fix data.paths")


def load_records(path: str) -> list[dict]:
    """Rows of a ShareGPT file: a JSON list, a single JSON object, JSON lines or parquet."""
    _check_file(path)
    if path.lower().endswith(".json"):
        single = _single_json_object(path)
        if single is not None:
            return [single]
    import datasets
    builder = "parquet" if path.lower().endswith(".parquet") else "json"
    try:
        ds = datasets.load_dataset(builder, data_files=os.path.abspath(path), split="train")
    except Exception as e:  # datasets wraps parse errors in several exception types
        cause = e.__cause__ or e
        raise S2DError(f"cannot read {path} as {builder}: {type(cause).__name__}: "
                       f"{str(cause).splitlines()[0] if str(cause) else ''}; fix the file "
                       f"(UTF-8 JSON / JSON lines, or parquet)") from e
    return ds.to_list()


def _single_json_object(path: str) -> dict | None:
    """The object if the file is one JSON object (e.g. axolotl's fixture), else None.

    `datasets` would read a top-level object as columns, not as one row.
    """
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"{"):
        return None
    text = read_text(path, "data file")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several objects: JSON lines in a .json file
            return None
    return parse_json(text, path, "data file")  # raises the one-line error


def load_text_documents(path: str) -> list[str]:
    """Non-empty documents of a plain-text corpus."""
    _check_file(path)
    text = read_text(path, "data file")
    return [d.strip("\n") for d in _DOC_SPLIT.split(text) if d.strip()]


def row_id(row, path: str, index: int) -> str:
    """A row's "id" field if it has one, else file#index: what warnings name."""
    rid = row.get("id") if isinstance(row, dict) else None
    return str(rid) if rid not in (None, "") else f"{os.path.basename(path)}#{index}"


def load_token_rows(path: str, vocab_size: int) -> list[dict]:
    """Rows {"input_ids": [int], "learn_from": int} of a token-id JSON-lines file, checked:
    ids within the vocabulary, 0 <= learn_from <= len(input_ids)."""
    _check_file(path)
    rows = []
    for n, line in enumerate(read_text(path, "data file").splitlines(), 1):
        if not line.strip():
            continue
        row = parse_json(line, path, "data file", n)
        ids = row.get("input_ids") if isinstance(row, dict) else None
        start = row.get("learn_from") if isinstance(row, dict) else None
        if (not isinstance(ids, list) or not isinstance(start, int)
                or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)
                or not 0 <= start <= len(ids)):
            raise S2DError(f"{path}:{n} is not a token row {{\"input_ids\": [ids < {vocab_size}], "
                           f"\"learn_from\": n <= len(input_ids)}}; regenerate the file with the "
                           f"model's tokenizer")
        rows.append({"input_ids": ids, "learn_from": start})
    return rows
