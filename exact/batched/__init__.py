"""The batched LoRA attack: B sequences averaged in one LoRA update, read by whitened bag recovery and a
joint search scored by every adapted layer's span test (`attack.BatchedLoRA`); with `wide_sites`, the same search on
a full-weight update whose batch outnumbers the model's width."""

from exact.batched.attack import BatchedLoRA, BatchedOptions, BatchedResult, least_squares_check
from exact.batched.bag import Bag, somp
from exact.batched.sites import Site, adapter_sites, wide_sites
from exact.batched.whitening import SiteWhitening

__all__ = ["Bag", "BatchedLoRA", "BatchedOptions", "BatchedResult", "Site", "SiteWhitening", "adapter_sites", "wide_sites",
           "least_squares_check", "somp"]
