"""GPT pretraining (Megatron-LM's training loop on ZeRO-DP x tensor parallelism).

- ``sections`` / ``config``: self-validating config dataclasses named after Megatron's flags (the
  model section is ``models.gpt.GPTConfig``); ``config_values``: config-file values as field types;
  ``arguments``: YAML/TOML file + command-line overrides;
- ``setup``: the order of the steps, in one place (``run``: the program; ``build_trainer``: the
  build steps, each taking what an earlier one returned); ``build``: the ``build_*`` steps (parallel
  state, data, model or pipeline stage, ZeRO optimizer, train state, throughput model);
  ``preflight``: checks before training (writable directories, --compile support, resume, the --save
  lock); ``hf_init``: --init-from-hf; ``startup_report``: the start-up reports (groups and hosts,
  pipeline layout, expected DP bytes); the run's layout (degrees, micro-batches, global batch) is
  ``hybrid.layout.RunLayout``, resolved by ``TrainConfig.validate_for_world``;
- ``trainer``: the loop; ``lr_schedule``; ``metrics`` (console + TensorBoard); ``exit`` (SIGTERM,
  time limit); ``resume`` (resume bookkeeping on top of hybrid.checkpoint);
- ``dry_run``: check a many-GPU layout on one CPU process.
"""
