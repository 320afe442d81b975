"""End-to-end tests against a real vLLM server (see conftest.py)."""
