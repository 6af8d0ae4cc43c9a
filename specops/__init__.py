"""specops: speculative decoding that stays fast and safe in production.

Sub-packages: ``decoder`` (runtime), ``kernels`` (Triton + PyTorch references),
``controller`` (control loop), ``policies`` (YAML schema, store, rollout),
``alerts`` (rules, webhooks), ``telemetry`` (the metrics contract shared by the
runtime and the controller). ``controller``, ``policies``, ``alerts`` and
``telemetry`` never import torch.
"""

__version__ = "0.1.0"
