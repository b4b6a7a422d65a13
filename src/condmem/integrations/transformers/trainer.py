"""`EngramTrainer`: Hugging Face `Trainer` whose gradient norm takes sparse table gradients.

`Trainer` measures (and clips) the gradient norm with `torch.nn.utils.clip_grad_norm_`
after every step, even with ``max_grad_norm=0``; before torch 2.14 that function cannot take
the norm of a sparse gradient (`NotImplementedError` for `SparseCPU` / `SparseCUDA`), and
Engram tables have sparse gradients. This subclass measures and clips with condmem's
`clip_grad_norm_`, which coalesces sparse gradients so each row counts once: one global
norm over the backbone and the tables, as a plain loop with `engram_optimizer` computes it.
"""

from __future__ import annotations

import transformers

from condmem.train.optim import clip_grad_norm_


class EngramTrainer(transformers.Trainer):
    """`transformers.Trainer` for a model with Engram tables (any torch version)."""

    def _clip_grad_norm(self, model):
        return clip_grad_norm_(list(model.parameters()), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = clip_grad_norm_(list(model.parameters()), 0.0)  # 0: measure only
        return float(grad_norm)
