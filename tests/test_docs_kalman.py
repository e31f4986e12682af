"""The code of the Kalman pages (linear and nonlinear filters, and the time axis
split over devices) runs as written; the other pages' in test_docs.py."""

import pytest
from helpers import block_params, KALMAN_PAGES, run_block


@pytest.mark.parametrize("code", block_params(KALMAN_PAGES))
def test_python_blocks(code):
    run_block(code)
