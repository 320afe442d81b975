"""DP balance simulator (see balance_sim.__main__): not the product, a user of it.

It drives the product's scheduler classes (``vllm_balance``) on the installed vLLM; the product
never imports it (tests/test_repo_hygiene.py). Shipped in the same wheel, with the
``vllm-balance-sim`` script and the ``sim`` extra.
"""
