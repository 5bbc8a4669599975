"""OpenAI-compatible HTTP serving on top of the paged engine (`pagedserve serve`)."""
