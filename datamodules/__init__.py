"""Data for the attacks: corpora, tokenisation, pseudo-data, and the client simulation that turns
samples into the updates a server observes.

Only `datamodules.text_inversion` imports Lightning; the subpackages `federated` and `text` are plain
Python/PyTorch so that `exact/` and scripts can use them without it.
"""
