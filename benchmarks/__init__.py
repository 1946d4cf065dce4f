"""Benchmarks, tools and investigations, run from the repository root as modules.

    python -m benchmarks.dager_benchmark --help        # a benchmark (its results: benchmarks/results/)
    python -m benchmarks.tools.paper_table --help      # a tool that builds the docs' tables and figures
    python -m benchmarks.investigations.dager.encoder_dager_diagnostics --help   # a one-off diagnosis

Not installed with the project (`pip install -e .` installs `lti`, `datamodules` and `exact` only):
`python -m` from the repository root finds this folder first.
"""
