"""Scripted eval conversations replayed against the real curryTrain MCP server (`python -m evals`).

See evals/README.md for what an eval is and how to add one; evals/runner.py replays them (with
evals/conversation.py, paths.py, checks.py and server.py), evals/routing.py is the deterministic skill-routing
matcher and evals/live.py the optional live-model mode.
"""
