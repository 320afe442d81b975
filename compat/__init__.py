"""Phase 2A fallback: balance scheduling on a vLLM whose ``Scheduler`` lacks the seam.

``vllm_balance.selection`` uses this package only when the installed vLLM has no
``Scheduler._should_stop_admitting_waiting``. It holds no vLLM source text: ``derive`` splices the
Phase 2A deltas into the installed vLLM's own ``schedule()`` at import time.

Delete this package, its fingerprints and its tests (``tests/test_compat_*.py``) on the day every
supported vLLM ships that seam (upstream_patch/, Phase 2B): ``selection.has_seam()`` is then always
true and nothing imports ``vllm_balance.compat``. Importing this package alone does not import vLLM.
"""
