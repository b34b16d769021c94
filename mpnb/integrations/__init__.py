"""mpnb inside the trainers people already use: telemetry, the live dashboard, Stop / Pause and
honest notices, with no change of trainer.

- :mod:`mpnb.integrations.transformers`: ``MpnbCallback`` for ``transformers.Trainer``, ``precision_args(mode)``.
- :mod:`mpnb.integrations.lightning`: ``MpnbCallback`` for the Lightning Trainer, ``precision(mode)``,
  ``fabric_telemetry`` for Fabric loops.
- :mod:`mpnb.integrations.accelerate`: ``watch(accelerator, model, optimizer)`` for Accelerate
  loops, ``LoopRecorder`` for any loop you write.

Each module imports its framework (optional extras: ``pip install 'mpnb[transformers]'``,
``'mpnb[lightning]'``); importing ``mpnb`` or this package imports none of them.
"""
