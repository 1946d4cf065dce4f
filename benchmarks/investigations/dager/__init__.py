"""Why DAGER loses sentences where it does (large batches, FedAvg, dropout, encoders): the diagnostics
and their notes (notes.md, fedavg_dager_diagnostics.md)."""
