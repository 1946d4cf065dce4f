"""Learned inversion of federated-learning client updates.

Importing this package must stay cheap and must not import Lightning: the plain-PyTorch parts
(target models, inverters, metrics) are used by `datamodules` and `exact` as well.
"""

__version__ = "0.1.0"
