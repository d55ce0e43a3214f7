"""Tests of calibration: reading step CSVs, recovering known factors, and the shipped A100 kernel tables."""

from __future__ import annotations

import json
import random

import pytest

from stallfree.costmodel import CostModel, CostModelError
from stallfree.costmodel.calibrate import (
    MeasuredStep,
    calibrate_profile,
    fit_allreduce,
    fit_cpu_overheads,
    fit_steps,
    read_steps_csv,
)

HEADER = "step,num_prefill_tokens,num_decodes,decode_context_sum,prefill_context_sum,num_tokens,seconds\n"


@pytest.fixture(scope="module")
def base():
    return CostModel.from_names("llama-3.1-8b", "h100-sxm", tp=2)


def _synthetic(truth: CostModel, n: int = 120, seed: int = 3) -> list[MeasuredStep]:
    """Steps priced by `truth`: decode-only (memory-bound) and prefill-heavy (compute-bound) ones."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        nd = rng.randrange(1, 128)
        ctx = rng.randrange(0, 4000)
        chunk = rng.choice([0, 0, rng.randrange(64, 4096)])
        start = rng.randrange(0, 8000) if chunk else 0
        tokens = nd + chunk
        pairs = chunk * start + chunk * (chunk + 1) / 2 + nd * (ctx + 1)
        t = truth.breakdown_counts(tokens, pairs, nd * ctx + start, nd).total_s
        out.append(MeasuredStep(tokens, nd, nd * ctx, t, chunk, start, None))
    return out


def test_fit_recovers_known_factors(base):
    """Steps made with mfu 0.6, mbu 0.8 and 1 ms overhead fit back to them, with ~0 held-out error."""
    truth = base.replace(mfu=0.6, mbu=0.8, overhead_s=0.001)
    cal = fit_steps(base, _synthetic(truth))
    assert cal.mfu == pytest.approx(0.6, rel=1e-6)
    assert cal.mbu == pytest.approx(0.8, rel=1e-6)
    assert cal.overhead_s == pytest.approx(0.001, rel=1e-6)
    assert cal.test.max < 1e-6 and cal.test.rows == 24
    assert cal.floor_test.mean > 0.1  # the uncalibrated floor was clearly off


def test_fit_link_util_when_asked(base):
    """link_util is recovered when it is among the fitted parameters."""
    truth = base.replace(mfu=0.7, mbu=0.9, link_util=0.5)
    cal = fit_steps(base, _synthetic(truth, 200), fit=("mfu", "mbu", "link_util"))
    assert (cal.mfu, cal.mbu, cal.link_util) == pytest.approx((0.7, 0.9, 0.5), rel=1e-6)


def test_fit_rejects_unknown_parameter_and_too_few_rows(base):
    """Fitting an unknown parameter, or from too few rows, is an explained error."""
    with pytest.raises(CostModelError, match="cannot fit 'speed'"):
        fit_steps(base, _synthetic(base, 10), fit=("speed",))
    with pytest.raises(CostModelError, match="need at least 5 measured steps"):
        fit_steps(base, _synthetic(base, 3))


def test_read_steps_csv_engine_columns(tmp_path):
    """The engine's step CSV columns are read; the prefill part keeps its offset."""
    path = tmp_path / "steps.csv"
    path.write_text(HEADER + "0,512,0,0,0,512,0.030\n1,256,4,4000,512,260,0.021\n")
    steps = read_steps_csv(path)
    assert steps[1] == MeasuredStep(260, 4, 4000, 0.021, 256, 512, None)
    tokens, pairs, kv_read, sampled = steps[1].counts()
    assert (tokens, kv_read, sampled) == (260, 4512, 4)
    assert pairs == 256 * 512 + 256 * 257 / 2 + 4000 + 4


def test_read_steps_csv_minimal_columns(tmp_path):
    """Only num_tokens, num_decodes, decode_context_sum and seconds are required."""
    path = tmp_path / "s.csv"
    path.write_text("num_tokens,num_decodes,decode_context_sum,seconds\n10,2,100,0.01\n")
    assert read_steps_csv(path) == [MeasuredStep(10, 2, 100, 0.01, 8, 0, None)]


@pytest.mark.parametrize(
    "text,match",
    [
        ("num_tokens,num_decodes,seconds\n1,1,0.1\n", "missing column 'decode_context_sum'"),
        (HEADER + "0,1,1,0,0,2,abc\n", "line 2: column 'seconds' is not a number"),
        (HEADER + "0,1,1,0,0,2,0\n", "line 2: column 'seconds' out of range"),
        (HEADER + "0,5,1,0,0,2,0.1\n", "exceed num_tokens"),
        (HEADER, "holds no rows"),
    ],
    ids=["missing", "nan", "zero-seconds", "counts", "empty"],
)
def test_read_steps_csv_errors(tmp_path, text, match):
    """A bad CSV raises CostModelError naming the column (and line)."""
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(CostModelError, match=match):
        read_steps_csv(path)


def test_read_steps_csv_missing_file(tmp_path):
    """A missing file raises CostModelError saying it cannot be read."""
    with pytest.raises(CostModelError, match="cannot read"):
        read_steps_csv(tmp_path / "nope.csv")


def test_fit_allreduce_recovers_line():
    """All-reduce rows (size in bytes) made with 10 us latency and 200 GB/s fit back to those values."""
    base = CostModel.from_names("codellama-34b", "a100", tp=2)
    rows = [
        {
            "num_workers": "2",
            "size": str(s),
            "time_stats.all_reduce.median": str((10e-6 + s / 200e9) * 1e3),
        }
        for s in range(2048, 8_000_000, 65536)
    ]
    fit = fit_allreduce(rows, base)
    assert fit.latency_s == pytest.approx(10e-6, rel=1e-6)
    assert fit.bw_bytes_per_s == pytest.approx(200e9, rel=1e-6)
    assert fit.link_util == pytest.approx(200 / 300, rel=1e-6)
    assert fit.test.max < 1e-6


def test_builtin_profile_calibration():
    """The shipped A100/CodeLlama-34B tables calibrate to a held-out median error <= 8% and p90 <= 25%
    in every token-count bucket, where the floor is 30-50% fast."""
    cal, ar, n = calibrate_profile("a100-codellama34b-tp2")
    assert n > 10_000
    assert [label for label, _ in cal.test_by_bucket] == ["<=64", "65-512", ">512"]
    for label, stats in cal.test_by_bucket:
        assert stats.rows > 100, label
        assert stats.median <= 0.08 and stats.p90 <= 0.25, (label, stats)
    assert all(s.median > 0.3 for _, s in cal.floor_by_bucket)
    assert cal.test.mean < 0.1 < cal.floor_test.mean
    assert cal.kernel_launch_s > 0 and cal.per_seq_s > 0 and cal.cpu is not None
    assert 100e9 < ar.bw_bytes_per_s < 300e9 and 0 < ar.latency_s < 50e-6


def test_builtin_allreduce_sizes_are_bytes():
    """Read as bytes, the shipped A100 all-reduce table gives about 158 GB/s, under NVLink3's 300 GB/s."""
    cal, ar, _ = calibrate_profile("a100-codellama34b-tp2", stride=50)
    assert ar.bw_bytes_per_s == pytest.approx(158e9, rel=0.05)
    assert ar.link_util == pytest.approx(ar.bw_bytes_per_s / 300e9) and ar.link_util < 1
    assert cal.link_util == pytest.approx(ar.link_util)


def test_fit_allreduce_refuses_bandwidth_above_link_peak():
    """A table that implies more than the link's peak (here 400 GB/s over a 300 GB/s link) is refused."""
    base = CostModel.from_names("codellama-34b", "a100", tp=2)
    rows = [
        {"num_workers": "2", "size": str(s), "time_stats.all_reduce.median": str((5e-6 + s / 400e9) * 1e3)}
        for s in range(2048, 8_000_000, 65536)
    ]
    with pytest.raises(CostModelError, match=r"implies 400 GB/s .* above the link's peak of 300 GB/s"):
        fit_allreduce(rows, base)


def test_unknown_profile_is_explained():
    """An unknown profile name lists the built-in profiles."""
    with pytest.raises(CostModelError, match="built-in profiles: a100-codellama34b-tp2"):
        calibrate_profile("h100-nothing")


def _synthetic_overheads(truth: CostModel, n: int = 150, seed: int = 5) -> list[MeasuredStep]:
    """Steps priced by `truth`, small and large, decode-only and mixed (one chunk each)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        nd = rng.randrange(1, 200)
        ctx = rng.randrange(0, 3000)
        chunk = rng.choice([0, rng.randrange(1, 64), rng.randrange(64, 4096)])
        seqs = nd + (1 if chunk else 0)
        pairs = chunk * (chunk + 1) / 2 + nd * (ctx + 1)
        t = truth.breakdown_counts(nd + chunk, pairs, nd * ctx, nd, seqs).total_s
        out.append(MeasuredStep(nd + chunk, nd, nd * ctx, t, chunk, 0, nd))
    return out


def test_fit_recovers_overhead_terms(base):
    """Kernel-launch, per-token and per-sequence costs used to price steps are fitted back."""
    truth = base.replace(mfu=0.7, mbu=0.8, kernel_launch_s=5e-6, per_token_s=2e-6, per_seq_s=30e-6)
    cal = fit_steps(
        base, _synthetic_overheads(truth), fit=("mfu", "mbu", "kernel_launch_s", "per_token_s", "per_seq_s")
    )
    got = (cal.mfu, cal.mbu, cal.kernel_launch_s, cal.per_token_s, cal.per_seq_s)
    assert got == pytest.approx((0.7, 0.8, 5e-6, 2e-6, 30e-6), rel=1e-6)
    assert cal.test.max < 1e-9
    assert {k for k, _ in cal.test_by_kind} == {"decode", "prefill", "mixed"}


def test_fit_refuses_overhead_with_kernel_launch(base):
    """overhead_s and kernel_launch_s are one column for one model: fitting both is refused."""
    with pytest.raises(CostModelError, match="cannot fit overhead_s and kernel_launch_s together"):
        fit_steps(base, _synthetic(base, 20), fit=("overhead_s", "kernel_launch_s"))


def test_fit_cpu_overheads_line():
    """A CPU table made as 1 ms + 40 us per sequence fits back to that line."""
    rows = [
        {
            "batch_size": str(b),
            "schedule_median": "0.1",
            "sampler_e2e_median": str(0.5 + 0.02 * b),
            "prepare_inputs_e2e_median": "0.2",
            "process_model_outputs_median": str(0.2 + 0.02 * b),
        }
        for b in range(8, 136, 8)
    ]
    cpu = fit_cpu_overheads(rows)
    assert (cpu.step_s, cpu.per_seq_s) == pytest.approx((1e-3, 40e-6), rel=1e-9)
    with pytest.raises(CostModelError, match="missing column 'schedule_median'"):
        fit_cpu_overheads([{"batch_size": "8"}] * 3)


@pytest.mark.parametrize(
    ("fit", "needle"),
    [("mfu,mfu", "--fit: 'mfu' is given twice in 'mfu,mfu'"),
     ("", "--fit '': name the parameters to fit"),
     ("mfu,,mbu", "--fit: an empty item in 'mfu,,mbu'")],
    ids=["twice", "empty", "empty-item"],
)
def test_calibrate_fit_list_is_checked_before_the_csv_is_read(fit, needle, tmp_path, capsys):
    """--fit names each parameter once: a repeat (a singular system, 'nothing was fitted', exit 0), an empty
    value (the default fit, silently) or an empty item is refused in one line, exit 2, before the CSV is read
    (the file here does not exist)."""
    from stallfree.cli import main

    argv = ["calibrate", "--csv", str(tmp_path / "none.csv"), "--model", "llama-3.1-8b", "--gpu", "h100-sxm",
            "--fit", fit]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_a_profile_fitted_to_another_model_or_gpu_warns(capsys):
    """The built-in profile records CodeLlama-34B on A100 at tp 2: fitting it to Llama-3.1-8B on H200 warns on
    stderr, once, with both shapes and both GPUs; fitting it to what it was measured on says nothing."""
    from stallfree.cli import main

    argv = ["calibrate", "--profile", "a100-codellama34b-tp2", "--tp", "2", "--json"]
    assert main([*argv, "--model", "llama-3.1-8b", "--gpu", "h200"]) == 0
    err = capsys.readouterr().err
    assert err == (
        "stallfree calibrate: warning: profile 'a100-codellama34b-tp2' was measured on a model of hidden size 8192, "
        "query heads 64, KV heads 8, MLP size 22016 (codellama-34b), where llama-3.1-8b has 4096, 32, 8, 14336; on "
        "a100-sxm-80gb, not h200: the factors fitted to it are of those kernel times, not of llama-3.1-8b at tp 2 "
        "on h200\n")
    assert main([*argv, "--model", "codellama-34b", "--gpu", "a100"]) == 0
    assert capsys.readouterr().err == ""


def test_a_profile_folder_is_compared_by_its_table_shapes(tmp_path):
    """A folder's tables record the model's shape and tp (the mlp table's columns) but not the GPU: the shape
    is compared, the GPU is not."""
    import shutil
    import warnings
    from importlib import resources

    from stallfree.costmodel import CostModelWarning

    src = resources.files("stallfree.costmodel").joinpath("data/profiles/a100_codellama34b_tp2")
    for name in ("mlp.csv.gz", "attention.csv.gz", "all_reduce.csv.gz", "cpu_overheads.csv"):
        with resources.as_file(src.joinpath(name)) as path:
            shutil.copy(path, tmp_path / name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CostModelWarning)
        calibrate_profile(tmp_path, CostModel.from_names("codellama-34b", "h100-sxm", tp=2, dtype="fp16"), stride=50)
    with pytest.warns(CostModelWarning) as caught:
        calibrate_profile(tmp_path, CostModel.from_names("llama-3.1-8b", "h100-sxm", tp=2), stride=50)
    assert [str(w.message) for w in caught] == [
        f"profile {str(tmp_path)!r} was measured on a model of hidden size 8192, query heads 64, KV heads 8, MLP size "
        "22016, where llama-3.1-8b has 4096, 32, 8, 14336: the factors fitted to it are of those kernel times, not "
        "of llama-3.1-8b at tp 2 on h100-sxm"]


@pytest.mark.parametrize("holdout", ["0", "1", "nan"])
def test_calibrate_holdout_is_checked_before_the_data_is_read(holdout, tmp_path, capsys):
    """--holdout outside (0, 1) is refused naming the flag, exit 2, before the CSV is read (it does not exist)."""
    from stallfree.cli import main

    argv = ["calibrate", "--csv", str(tmp_path / "none.csv"), "--model", "llama-3.1-8b", "--gpu", "h100-sxm",
            "--holdout", holdout]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"stallfree calibrate: error: --holdout {holdout}: the fraction of rows held "
                                       "out must be above 0 and below 1\n")


def test_a_holdout_that_leaves_too_few_fitting_rows_says_so(base):
    """20 steps are enough to fit 3 parameters; --holdout 0.9 leaves 2 of them, which is what the error says
    (it said "need at least 5 measured steps ..., got 20"), with the largest holdout that fits, which does. The
    CPU line of a profile's 13-row table is refused the same way (it said "one batch size only?")."""
    steps = _synthetic(base, 20)
    with pytest.raises(CostModelError) as err:
        fit_steps(base, steps, holdout=0.9)
    assert str(err.value) == ("--holdout 0.9 holds out 18 of the 20 measured steps and leaves 2 to fit 3 parameters, "
                              "which needs at least 4: give --holdout 0.8 or less")
    assert (fit_steps(base, steps, holdout=0.8).train.rows, fit_steps(base, steps, holdout=0.8).test.rows) == (4, 16)
    rows = [{"batch_size": str(b), "schedule_median": "0.1", "sampler_e2e_median": str(0.5 + 0.02 * b),
             "prepare_inputs_e2e_median": "0.2", "process_model_outputs_median": "0.2"} for b in range(8, 112, 8)]
    with pytest.raises(CostModelError, match=r"^--holdout 0.9 holds out 12 of the 13 rows of the cpu_overheads table "
                       r"and leaves 1 to fit 2 parameters, which needs at least 2: give --holdout 0.84 or less$"):
        fit_cpu_overheads(rows, holdout=0.9)
    assert fit_cpu_overheads(rows, holdout=0.84).rows == 2


def test_an_empty_bucket_shows_no_error(tmp_path, capsys):
    """Decode-only steps of at most 64 tokens: the held-out buckets and kinds they do not fill say "-" (and
    null in --json), not a 0.0% error; the filled ones keep their figures."""
    from stallfree.cli import main

    truth = CostModel.from_names("llama-3.1-8b", "h100-sxm", tp=1, mbu=0.8, overhead_s=0.002)
    path = tmp_path / "steps.csv"
    lines = [f"{i},0,{nd},{nd * 1000},0,{nd},{truth.breakdown_counts(nd, nd * 1001, nd * 1000, nd).total_s}"
             for i, nd in enumerate(range(1, 61, 3))]
    path.write_text(HEADER + "\n".join(lines) + "\n")
    argv = ["calibrate", "--csv", str(path), "--model", "llama-3.1-8b", "--gpu", "h100-sxm"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fitted on 16 of 20 steps, tested on 4 held-out steps\n" in out
    assert "held-out tokens <=64: |error| median 0.0%  p90 0.0%  max 0.0%  (4 steps)\n" in out
    for label in ("tokens 65-512", "tokens >512", "kind prefill", "kind mixed"):
        assert f"held-out {label}: |error| median -  p90 -  max -  (0 steps)\n" in out
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["test_error_by_bucket"][">512"] == {"rows": 0, "mean": None, "median": None, "p90": None, "max": None}
    assert got["test_error_by_kind"]["decode"]["rows"] == 4 and got["test_error_by_kind"]["decode"]["max"] < 1e-6


@pytest.mark.parametrize(("name", "said"), [
    ("gpu.txt", "gpu.txt: the file name must end in .json (the format it is written in), got '.txt'"),
    ("gpu", "gpu: the file name must end in .json (the format it is written in), got 'no suffix'"),
    ("none/gpu.json", "none/gpu.json: the directory {tmp}/none does not exist"),
    (".", ": is a directory; give a file name (.json)"),
], ids=["txt", "no-suffix", "no-directory", "directory"])
def test_calibrate_save_gpu_is_checked_before_the_fit(name, said, tmp_path, capsys):
    """--save-gpu writes JSON that `--gpu FILE` reads by its .json name: another name, a directory or a missing
    directory is refused naming the flag, exit 2, before the CSV is read (it does not exist) and nothing is
    written."""
    from stallfree.cli import main

    target = tmp_path / name
    argv = ["calibrate", "--csv", str(tmp_path / "none.csv"), "--model", "llama-3.1-8b", "--gpu", "h100-sxm",
            "--save-gpu", str(target)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stallfree calibrate: error: --save-gpu {target}") and err.count("\n") == 1, err
    assert said.format(tmp=tmp_path) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
