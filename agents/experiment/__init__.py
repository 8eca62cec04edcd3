"""Experiments as a workflow (`busctl experiment`): a dataset × variants × repeats, each cell one
session on the running topology, scored, journaled in the event log, resumable and reported.

    spec.py     the spec file (TOML) and the dataset (JSONL), checked with errors naming the key
    scoring.py  the scorers (exact, includes, regex, number, json_field, python)
    runner.py   runs the missing cells, journals each finished one (`experiment_sample` events)
    report.py   per-variant statistics (Wilson / t intervals), paired comparison (McNemar exact)
"""
