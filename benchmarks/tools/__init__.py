"""Tools behind the docs: Table 2 from learning curves, curves side by side, and the behaviour check
that compares short training runs of two commits."""
