"""Hypothesis strategies for scheduler configurations and request mixes."""

from __future__ import annotations

from hypothesis import strategies as st

token_budgets = st.integers(min_value=1, max_value=64)
max_seqs = st.integers(min_value=1, max_value=6)
prompt_lens = st.integers(min_value=1, max_value=80)
max_news = st.integers(min_value=1, max_value=20)
# Values a careless caller might pass for a count: wrong types, zero, negatives, bools.
bad_counts = st.one_of(
    st.integers(max_value=0), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3)
)
