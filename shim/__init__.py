"""Phase 2B: balance scheduling on vLLM's ``Scheduler._should_stop_admitting_waiting`` seam.

This package is what stays after vLLM merges the seam (``upstream_patch/``); it stands on vLLM
and ``vllm_balance.config`` / ``log`` alone.
"""
