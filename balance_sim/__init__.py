"""DP balance simulator (see balance_sim.__main__)."""
