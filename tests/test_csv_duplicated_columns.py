"""Every CSV reader that looks columns up by name refuses a header that gives a column twice, naming it
(a dict of the row, or header.index, would silently keep one of the two)."""

from __future__ import annotations

import pytest

from stallfree._files import duplicated_column
from stallfree.costmodel.errors import CostModelDataError
from stallfree.costmodel.measured import read_steps_csv
from stallfree.sim.inputs.diurnal import read_rate_profile
from stallfree.sim.inputs.prices import PriceError, load_prices
from stallfree.validate.errors import ValidateDataError
from stallfree.validate.silicon import read_rows


def test_duplicated_column_compares_stripped_names():
    assert duplicated_column(["a", "b", " a"]) == "a"
    assert duplicated_column(["a", "b"]) is None and duplicated_column(None) is None


@pytest.mark.parametrize(
    "reader,error,text,message",
    [
        (read_steps_csv, CostModelDataError,
         "num_tokens,num_decodes,decode_context_sum,seconds,seconds\n10,2,100,0.01,5\n",
         "{q}: column 'seconds' appears twice in the header; give each column once"),
        (read_rate_profile, ValueError, "t_s,rate,rate\n0,1,1\n10,2,2\n",
         "--rate-profile {p}: column 'rate' appears twice in the header; give each column once"),
        (load_prices, PriceError, "gpu,usd_per_hour,gpu\nh100,2,a100\n",
         "--prices {p}: column 'gpu' appears twice in the CSV header; give each column once"),
        (read_rows, ValidateDataError, "model,mode,model\nx,agg,y\n",
         "{p}: column 'model' appears twice in the header; give each column once"),
    ],
    ids=["calibrate-csv", "rate-profile", "prices", "validate-silicon"],
)
def test_csv_with_a_column_twice_is_refused(tmp_path, reader, error, text, message):
    p = tmp_path / "f.csv"
    p.write_text(text)
    with pytest.raises(error) as info:
        reader(p)
    assert str(info.value) == message.format(p=p, q=repr(str(p)))
