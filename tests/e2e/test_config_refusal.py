"""A bad balance key on a real server's command line: the start-up stops with the one-line error.

Once, through ``vllm.entrypoints.openai.api_server`` as an operator starts it; every other refusal
(each key's wrong types, negative and non-finite seconds, the near-miss of the enable key) is
checked in-process on the same reader (tests/test_config.py, tests/test_operability.py).
"""

from __future__ import annotations

import pytest

from balance_testbed.server import MODEL_DTYPE, ServerError, ServerSpec, VllmServer

pytestmark = pytest.mark.timeout(900)

MISSPELLED = {"enable_balance_scheduling": True, "balance_max_frozen_step": 4}
ERROR = (
    "BalanceConfigError: additional_config.balance_max_frozen_step is not a balance scheduling "
    "key; did you mean 'balance_max_frozen_steps'? see docs/operations.md, \"Configuration keys\""
)


def test_a_misspelled_key_stops_the_server_at_start_up_naming_the_key(tiny_model, tmp_path):
    """Ignored, the typo would leave the hold unbounded while the operator believes it bounded."""
    spec = ServerSpec(tiny_model, dtype=MODEL_DTYPE, additional_config=MISSPELLED)
    server = VllmServer(spec, tmp_path)
    with pytest.raises(ServerError, match="exited with"):
        with server:
            pytest.fail("the server came up with a misspelled balance key")
    log = server.log_text()
    assert ERROR in log, server.log_tail(60)
    assert "Balance DP" not in log  # no engine ran a step
    assert server.stop_report.get("killed", []) == [], server.stop_report
