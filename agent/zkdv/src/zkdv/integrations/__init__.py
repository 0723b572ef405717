"""ZKDV inside the training frameworks people use, their scripts unchanged.

* :mod:`zkdv.integrations.transformers`: Hugging Face ``transformers.Trainer`` (PEFT
  adapters and ``accelerate launch`` included): ``prove(trainer, ...)`` before
  ``trainer.train()``;
* :mod:`zkdv.integrations.lightning`: Lightning's ``Trainer``: a
  :class:`~zkdv.integrations.lightning.ZKDVCallback` in its ``callbacks``.

Both build on :mod:`zkdv.torch` (``docs/integrations.md`` says what each proves and what
it refuses). Neither is imported by ``import zkdv``; each imports its framework.
"""
