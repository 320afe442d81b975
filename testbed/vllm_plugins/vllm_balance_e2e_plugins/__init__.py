"""Test-support vLLM plugins for the e2e server (see each module; not part of the product)."""
