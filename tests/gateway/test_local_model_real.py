"""`busctl up --model-file` with a real GGUF model: runs only when AGENT_BUS_GGUF names the file.

    AGENT_BUS_GGUF=/path/to/model.gguf python -m pytest tests/gateway/test_local_model_real.py

Needs the `local` extra (`pip install 'agent-bus[local]'`); ../shared/local-llm/setup.sh makes a
small model (Qwen2.5-Coder-0.5B-Instruct, ~470 MB). Slow on purpose: it loads and runs the model.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import Proc, busctl

GGUF = os.environ.get("AGENT_BUS_GGUF", "")

pytestmark = [
    pytest.mark.skipif(not GGUF, reason="set AGENT_BUS_GGUF to a .gguf model file "
                                        "(see ../shared/local-llm/README.md)"),
    pytest.mark.skipif(importlib.util.find_spec("xllamacpp") is None,
                       reason="llama.cpp's server is not installed: pip install 'agent-bus[local]'"),
    pytest.mark.timeout(600),
]


def test_up_with_a_model_file_answers_with_the_hosted_model(tmp_path: Path) -> None:
    proc = Proc(busctl("up", "--json", "--hub", "tcp://127.0.0.1:0", "--model-file", GGUF), cwd=tmp_path)
    try:
        ready = proc.wait_ready(timeout=300)  # the gateway loads the model before it is ready
        hub = ready["endpoint"]
        done = subprocess.run(busctl("run", "--hub", hub, "-q", "Reply with one word: hello"),
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip(), "the model gave no answer"
        status = subprocess.run(busctl("status", "--hub", hub), capture_output=True, text=True,
                                timeout=60, cwd=tmp_path).stdout
        assert "model local (hosted GGUF), context window 4096" in status, status
        assert "cost $0.0000" in status, status  # a model on this machine costs nothing
    finally:
        code = proc.stop(timeout=60)
    assert code == 0, proc.output()
