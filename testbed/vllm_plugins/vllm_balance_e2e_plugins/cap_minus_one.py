"""The reverted ``>= cap - 1`` gate as a scheduler class a server can name (``nox -s bench-serve``).

``--scheduler-cls vllm_balance_e2e_plugins.cap_minus_one.CapMinusOneScheduler`` with balance on:
activation keeps a user-set class that is already balance-aware (``select_scheduler_cls``), so
the engine cores run the simulator's own ``cap-1`` variant (``balance_sim/policies.py``,
one definition for both), built on the product's class for the installed vLLM.
"""

from balance_sim.policies import cap_minus_one_class

CapMinusOneScheduler = cap_minus_one_class()
