"""Launching: the topology file (`topology`), `busctl up`/`down` (`up`), child supervision (`supervisor`)."""
