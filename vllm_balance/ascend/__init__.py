"""Everything this package does because of vllm-ascend, in one folder.

- ``source``: vllm-ascend's ``AscendConfig``, the first source of the enable key on Ascend
  (read by ``vllm_balance.config``);
- ``takeover``: vllm-ascend's platform patches applied before anything is checked
  (``vllm_balance.plugin``), its own balance patch stepped aside from or taken over, each refusal
  named (``vllm_balance.activation``), and ``patches``, the take-over's run-time patches.

Those three modules are its only callers: ``plugin.register`` (one call), ``config``'s enable
key (one) and ``activation.decide`` / ``activate_for`` (three). The day vllm-ascend delegates to
this package instead of shipping its own copy of ``schedule()`` (``upstream_patch/vllm-ascend/``),
the take-over goes: delete ``takeover.py`` and ``patches.py`` and those four calls.
"""
