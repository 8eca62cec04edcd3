"""The coordinator process: hosts agents as actors (`process`), wires the loop to the bus (`bus_adapters`),
keeps conversations and run journals (`persistence`, `durable`) and lets agents call agents (`multiagent`).
"""
