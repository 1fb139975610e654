"""The public multi-rank test harness, for the tests and the benchmarks (never imported by the
framework itself):

* :mod:`hybrid.testing.multirank`: ``run_on_ranks(fn, world_size)`` runs ``fn`` on N spawned CPU ranks
  joined by gloo (or NCCL, one GPU a rank), returns each rank's result and re-raises a rank's failure
  with its traceback; a deadlock fails after a wall-clock timeout instead of hanging.
* :mod:`hybrid.testing.corpus`: ``build_corpus(root)``, a tiny real corpus (sentencepiece tokenizer and a
  Megatron .bin/.idx dataset) for runs of the real trainer.
* :mod:`hybrid.testing.subprocesses`: ``child_env()``, the environment of a child process that is not a
  rank of the calling job (a torchrun job, a tool, a network-namespace host).
"""
