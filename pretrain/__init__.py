"""GPT pretraining (Megatron-LM's training loop on ZeRO-DP x tensor parallelism).

- ``sections`` / ``config``: self-validating config dataclasses named after Megatron's flags (the
  model section is ``models.gpt.GPTConfig``); ``config_values``: config-file values as field types;
  ``arguments``: YAML/TOML file + command-line overrides;
- ``setup``: the ``build_*`` steps (parallel state, data, model, ZeRO optimizer) and ``run``;
- ``trainer``: the loop; ``lr_schedule``; ``metrics`` (console + TensorBoard); ``exit`` (SIGTERM,
  time limit); ``resume`` (resume bookkeeping on top of hybrid.checkpoint);
- ``dry_run``: check a many-GPU layout on one CPU process.
"""
