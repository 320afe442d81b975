"""Imported once by the harness's forkserver, so each rank process forks with vLLM loaded.

Importing vLLM + torch costs 5-10 s per process (far more on a loaded 2-core machine); forking
from a process that already did it is what vLLM's own launcher does with the ``fork`` start
method. Nothing here creates threads, sockets or process groups: that all happens in the rank.
"""

import torch.distributed  # noqa: F401
import vllm.v1.engine.core  # noqa: F401
import vllm.v1.engine.utils  # noqa: F401
from vllm.config import SchedulerConfig  # noqa: F401

import balance_testbed.factories  # noqa: F401
import vllm_balance.activation  # noqa: F401
import vllm_balance.plugin  # noqa: F401
import vllm_balance.registry  # noqa: F401
import vllm_balance.shim.engine_core  # noqa: F401
from balance_testbed import variants  # noqa: F401
from tests.multiproc import rank, standin  # noqa: F401
