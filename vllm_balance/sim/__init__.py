"""DP balance simulator (see vllm_balance.sim.__main__)."""
