"""Stand-in for ``vllm_ascend/patch/platform/__init__.py`` at vllm-ascend 182b75ea.

The real package imports every platform patch; L39-40 import the two that replace names balance
scheduling cares about, in this order. The others patch unrelated places and are left out.
"""

import vllm_ascend.patch.platform.patch_balance_schedule  # noqa: F401
import vllm_ascend.patch.platform.patch_dyntra_lb_core  # noqa: F401
