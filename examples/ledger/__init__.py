"""A third-party GPU-seconds ledger over the driver's claim lifecycle events (standalone: nats-py only)."""
