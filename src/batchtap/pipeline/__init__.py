"""The host side beside training, in three parts by job.

* :mod:`batchtap.pipeline.chain`: what happens to a flushed block (decode, validate, reduce across
  ranks, rules, dispatch to sinks) and the one :class:`~batchtap.pipeline.chain.core.PipelineCore`
  that takes every message, wherever it runs.
* :mod:`batchtap.pipeline.transport`: how the training thread's messages reach that core: a thread
  of the training process, or a process of its own fed through a pipe and shared memory.
* :mod:`batchtap.pipeline.ranks`: process-group facts, and the agreement that makes every rank stop
  and apply the same verdicts at the same flush step.

The chain imports neither of the other two, so it runs the same under either transport;
``tests/test_architecture.py`` checks that.
"""
