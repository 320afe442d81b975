"""Balance scheduling on a vLLM whose ``Scheduler`` lacks the seam.

``vllm_balance.selection`` uses this package only when the installed vLLM has no
``Scheduler._should_stop_admitting_waiting``. ``pause_state`` holds a frozen step with vLLM's own
``PauseState.PAUSED_NEW`` (no copy, no vLLM change); ``derive`` and ``scheduler``, the Phase 2A
copy, splice the gate into the installed vLLM's own ``schedule()`` at import time for the
releases whose ``PAUSED_NEW`` is not the contract's hold (``fingerprints.json``: vLLM 0.31). It
holds no vLLM source text. Importing this package alone does not import vLLM.
"""
