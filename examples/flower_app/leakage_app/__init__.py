"""A Flower app audited by the workbench's `LeakageAudit` (examples/flower_app/README.md)."""
