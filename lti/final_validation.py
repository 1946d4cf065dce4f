"""`ValidateAtLastStep`: a fit bounded by `max_steps` ends with a validation.

Lightning validates every `val_check_interval` steps only, so a run whose `max_steps` is not a multiple
of it (`lti fit ... --trainer.max_steps 20` under a config that validates every 300) ends with no
metrics, no results table and a checkpoint written after the last validation is not the last step's.
At the last step this callback asks the trainer to stop (`trainer.should_stop`), which makes Lightning
run the validation it runs before an early stop; when the last step is a validation step anyway,
nothing changes. Training is over at that point, so no weight and no training batch differ.
"""

from __future__ import annotations

from lightning.pytorch import Callback


class ValidateAtLastStep(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.enable_validation and 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True
