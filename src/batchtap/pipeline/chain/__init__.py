"""The pipeline's one chain: block -> decode -> validate -> reduce across ranks -> rules -> dispatch,
and :class:`~batchtap.pipeline.chain.core.PipelineCore`, which takes every message of
:mod:`batchtap.pipeline.chain.messages`. Knows nothing of how messages travel (the transport)."""
