"""Stand-in for ``vllm_ascend/patch/__init__.py`` (a comment registry; nothing runs)."""
