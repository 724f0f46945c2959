"""`gpu-dra nats auth-callout`: NATS auth callout that turns node-bound ServiceAccount tokens into
node-scoped NATS users (service.py decides, cli.py wires it)."""
