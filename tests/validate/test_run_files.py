"""Hostile run folders and vLLM results: a sparse requests.jsonl past the file limit, deep JSON, an
infinite timestamp. Each is one ValidateDataError (exit 2), not a MemoryError or a traceback."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from stallfree.validate.compare import read_vllm_result
from stallfree.validate.errors import ValidateDataError
from stallfree.validate.runs import read_run_folder

RUN = Path(__file__).parent / "data" / "run_small"


def _copy(tmp_path):
    return Path(shutil.copytree(RUN, tmp_path / "run"))


def test_sparse_requests_past_the_file_limit(tmp_path):
    folder = _copy(tmp_path)
    os.truncate(folder / "requests.jsonl", 3 << 30)  # sparse: nothing read or allocated
    with pytest.raises(ValidateDataError, match=r"requests\.jsonl: 3,221,225,472 bytes, over the limit of 1 GiB"):
        read_run_folder(folder)


def test_deep_meta_json(tmp_path):
    folder = _copy(tmp_path)
    (folder / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValidateDataError, match=r"meta\.json: JSON nested too deeply"):
        read_run_folder(folder)


def test_deep_request_line(tmp_path):
    folder = _copy(tmp_path)
    with (folder / "requests.jsonl").open("a") as fh:
        fh.write("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValidateDataError, match=r"requests\.jsonl:\d+: JSON nested too deeply"):
        read_run_folder(folder)


@pytest.mark.parametrize("value", ["1e309", "NaN", "-Infinity"])
def test_non_finite_timestamp(tmp_path, value):
    folder = _copy(tmp_path)
    p = folder / "requests.jsonl"
    lines = p.read_text().splitlines()
    lines[0] = lines[0].replace('"last_token_ts": 10.32', f'"last_token_ts": {value}')
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValidateDataError, match=r"requests\.jsonl:1: field 'last_token_ts' must be a finite number"):
        read_run_folder(folder)


@pytest.mark.parametrize("value, said", [("1e308", r"field 'last_token_ts' 1e\+308 is past 1e\+12 s"),
                                         ("2e8", r"the request spans 2e\+08 s from queued_ts to last_token_ts")])
def test_absurd_finite_timestamp(tmp_path, value, said):
    """A finite but absurd time (past any clock, or a request spanning years) is refused as a trace's is,
    rather than entering the averages."""
    folder = _copy(tmp_path)
    p = folder / "requests.jsonl"
    lines = p.read_text().splitlines()
    lines[0] = lines[0].replace('"last_token_ts": 10.32', f'"last_token_ts": {value}')
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValidateDataError, match=r"requests\.jsonl:1: " + said):
        read_run_folder(folder)


def test_deep_vllm_result(tmp_path):
    p = tmp_path / "r.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValidateDataError, match="nested too deeply"):
        read_vllm_result(p)
