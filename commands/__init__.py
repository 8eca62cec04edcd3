"""busctl's commands, one module per family; `cli.py` (the entry) loads each module when one of
its commands is used or listed by --help.

    base         what every command shares (error-to-exit mapping, --hub and CURVE options)
    topology     up, down
    processes    ps, restart, scale, logs
    parts        hub, worker, gateway, coordinator, fake-llm (one part of a topology)
    agent        run, chat, steer, follow-up, abort
    observe      status, watch, otel, ui
    experiment   export, replay, diff, experiment
    keys_config  keys, config
    mcp          mcp

The CLI is the edge of the product: it may import any of bus/, agents/ and tools/, and nothing
imports it (tests/test_import_graph.py).
"""
