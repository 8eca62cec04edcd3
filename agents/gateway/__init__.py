"""The LLM gateway process: serves `llm` on the hub (`process`) by calling providers (`engine`, `providers/`).

`fakellm` is the scripted model server `busctl fake-llm` runs, speaking the providers' real wire formats.
"""
