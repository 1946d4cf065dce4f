"""Lightning adapters for the exact attacks: each runs its attack on every evaluation batch's defended
update and logs its scores next to the learned attack's."""

from exact.callbacks.attacks import AttackCallback
from exact.callbacks.base import ExactAttackCallback
from exact.callbacks.dager import DagerCallback
from exact.callbacks.spear import SpearCallback

__all__ = ["AttackCallback", "DagerCallback", "ExactAttackCallback", "SpearCallback"]
