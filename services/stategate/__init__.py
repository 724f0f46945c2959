"""The state gate: the one door through which node services reach JetStream (see gate.py)."""
