"""`EngramTrainer`: Hugging Face `Trainer` that builds the Engram optimizer and clips sparse table gradients.

* Without ``optimizers=``, `Trainer` would build AdamW over every parameter, and AdamW
  refuses the tables' sparse gradients. `EngramTrainer` builds `engram_optimizer` instead,
  from the arguments ``learning_rate`` (tables at 5x), ``weight_decay`` (backbone matrices
  only), ``adam_beta1`` / ``adam_beta2`` and ``adam_epsilon``; ``optim`` is not read (pass
  ``optimizers=(engram_optimizer(model, ...), None)`` for other settings).
* It measures and clips the gradient norm with condmem's `clip_grad_norm_`, which
  coalesces sparse gradients so each row counts once: one global norm over the backbone
  and the tables, on any torch version. (A plain `Trainer` given `engram_optimizer` clips
  the same way through torch's own function: see `enable_sparse_grad_norm`.)
"""

from __future__ import annotations

import transformers

from condmem.integrations.transformers.optim import engram_optimizer
from condmem.train.optim import clip_grad_norm_


class EngramTrainer(transformers.Trainer):
    """`transformers.Trainer` for a model with Engram tables (any torch version)."""

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            args = self.args
            self.optimizer = engram_optimizer(
                self.model if model is None else model,
                lr=args.learning_rate,
                weight_decay=args.weight_decay,
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
            )
        return self.optimizer

    def _clip_grad_norm(self, model):
        return clip_grad_norm_(list(model.parameters()), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = clip_grad_norm_(list(model.parameters()), 0.0)  # 0: measure only
        return float(grad_norm)
